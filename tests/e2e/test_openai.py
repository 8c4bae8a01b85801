"""The official openai client talks to the router like to any OpenAI-compatible server."""

from __future__ import annotations

import openai
import pytest

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
