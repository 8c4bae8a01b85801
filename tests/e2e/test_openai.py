"""The official openai client talks to the router like to any OpenAI-compatible server."""

from __future__ import annotations

import random

import openai
import pytest

from tests.e2e.prompts import SENTENCES, prompt_of_about

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_matches_native_generate(client, router):
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    native = router.post("/generate", json={"text": "Once upon a time",
                                            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert completion.choices[0].text == native["text"]
    assert completion.usage.completion_tokens == native["meta_info"]["completion_tokens"]


def test_streamed_completion_adds_up_to_the_plain_one(client):
    plain = client.completions.create(model=MODEL, prompt="The router", max_tokens=8, temperature=0)
    stream = client.completions.create(model=MODEL, prompt="The router", max_tokens=8, temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == plain.choices[0].text


def test_chat_completion_plain_and_streamed(client):
    messages = [{"role": "user", "content": "Tell me about servers."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].finish_reason in ("length", "stop")
    assert plain.usage.completion_tokens <= 8 and plain.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == plain.choices[0].message.content


def test_bad_request_surfaces_as_openai_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, top_p=3)
    assert "top_p" in str(caught.value)


def test_n_choices_plain_and_streamed(client):
    """n = 3 through PD: three choices indexed 0..2, each ending at max_tokens (ignore_eos: exact counts on the random
    demo model), the prompt counted once and the completions summed, one id for a stream, one usage event."""
    messages = [{"role": "user", "content": "Tell me about routers."}]
    exact = {"max_tokens": 6, "temperature": 0.8, "extra_body": {"ignore_eos": True}}
    single = client.chat.completions.create(model=MODEL, messages=messages, **exact)
    plain = client.chat.completions.create(model=MODEL, messages=messages, n=3, **exact)
    assert [choice.index for choice in plain.choices] == [0, 1, 2]
    assert all(choice.finish_reason == "length" and choice.message.role == "assistant" for choice in plain.choices)
    assert plain.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert plain.usage.completion_tokens == 3 * 6
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 3 * 6

    stream = client.chat.completions.create(model=MODEL, messages=messages, n=3, stream=True,
                                            stream_options={"include_usage": True}, **exact)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    ids, usages = set(), []
    for chunk in stream:  # the client stops at the one `data: [DONE]`
        ids.add(chunk.id)
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2]  # (a random model's 6 tokens may all be special: no text asserted)
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert len(ids) == 1
    (usage,) = usages
    assert usage.prompt_tokens == single.usage.prompt_tokens and usage.completion_tokens == 3 * 6
    assert usage.total_tokens == usage.prompt_tokens + 3 * 6


# --- what evaluation harnesses and clients send (lm-eval's local-completions: echo, logprobs 1, max_tokens 1, a seed)

def test_echo_scores_the_prompt_as_generate_does(client, router, reference):
    """Every prompt token's logprob, echoed through PD, is /generate's (the prefill's, merged in front of the
    decode's), the first one null, with the prompt's text and offsets; max_tokens 0 scores the prompt alone."""
    prompt = prompt_of_about(reference.tokenizer, 110)
    ids = reference.tokenizer(prompt)["input_ids"]
    native = router.post("/generate", json={"text": prompt, "return_logprob": True, "logprob_start_len": 0,
                                            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    want = [entry[0] for entry in native["meta_info"]["input_token_logprobs"]]
    assert len(want) == len(ids) >= 100
    for max_tokens in (1, 0):
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1,
                                           temperature=0, seed=1234)
        choice, logprobs = answer.choices[0], answer.choices[0].logprobs
        assert choice.text.startswith(prompt) and len(logprobs.tokens) == len(ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert all(abs(got - w) <= 1e-3 for got, w in zip(logprobs.token_logprobs[1:len(ids)], want[1:], strict=True))
        assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[-1] < len(choice.text)
        assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == max_tokens
    assert choice.text == prompt  # max_tokens 0: the prompt alone
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                         temperature=0, stream=True)
    tokens = [token for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for token in chunk.choices[0].logprobs.tokens]
    assert len(tokens) == len(ids) + 2


def test_a_repeated_chat_prompt_reports_its_cached_tokens(client, router):
    """usage.prompt_tokens_details.cached_tokens, plain and streamed: the workers run SGLang's cache report."""
    words = SENTENCES.split()
    messages = [{"role": "user", "content": " ".join(random.Random("cached chat").choice(words) for _ in range(120))}]
    for _ in range(4):  # round robin over the two prefills: each has it cached after two
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True})
    (usage,) = [chunk.usage for chunk in streamed if chunk.usage is not None]
    for cached in (plain.usage, usage):
        assert cached.prompt_tokens_details.cached_tokens >= cached.prompt_tokens // 2, cached


def test_a_seed_gives_the_same_tokens_and_says_it_is_best_effort(client, cluster):
    """On CPU workers (pdcluster/plugins/cpu_seeded_sampling) the same seed samples the same tokens, on an idle
    cluster; another seed others. Not deterministic inference: the fingerprint says best effort."""
    for name in ("prefill-0", "decode-0"):
        assert "pdcluster cpu_seeded_sampling active" in cluster.processes[name].log_path.read_text(errors="replace")
    sampled = {"model": MODEL, "prompt": "The router", "max_tokens": 12, "temperature": 1.0,
               "extra_body": {"ignore_eos": True}}
    answers = [client.completions.create(seed=42, **sampled) for _ in range(3)]
    assert len({answer.choices[0].text for answer in answers}) == 1
    assert {answer.system_fingerprint for answer in answers} == {"pdcluster-best-effort"}
    others = [client.completions.create(seed=seed, **sampled).choices[0].text for seed in (1, 2)]
    assert any(text != answers[0].choices[0].text for text in others)


def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["param"] == "model"
