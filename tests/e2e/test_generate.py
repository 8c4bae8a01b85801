"""Disaggregated generation through the router is token-for-token what plain transformers produces."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import assert_matches

MAX_NEW = 16


@pytest.fixture(scope="module")
def prompts(reference) -> dict[str, str]:
    return {
        "few": "Hello, my name is",
        "hundred": prompt_of_about(reference.tokenizer, 100),
        "six_hundred": prompt_of_about(reference.tokenizer, 600),
    }


def greedy_body(text: str, max_new: int = MAX_NEW, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, **extra}


def sse_events(response: httpx.Response) -> list[dict]:
    events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("size", ["few", "hundred", "six_hundred"])
def test_generate_equals_transformers(router, reference, prompts, size):
    ref = reference.greedy(prompts[size], MAX_NEW)
    response = router.post("/generate", json=greedy_body(prompts[size]))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)
    assert_matches(answer["output_ids"], ref, reference.eos)
    if size == "few":
        assert answer["meta_info"]["completion_tokens"] == MAX_NEW or ref.ids[-1] == reference.eos


@pytest.mark.parametrize("size", ["few", "hundred", "six_hundred"])
def test_streamed_generate_equals_transformers(router, reference, prompts, size):
    ref = reference.greedy(prompts[size], MAX_NEW)
    with router.stream("POST", "/generate", json=greedy_body(prompts[size], stream=True)) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert len(events) > 1  # streamed as it was generated, not in one piece
    assert_matches(events[-1]["output_ids"], ref, reference.eos)
    assert events[-1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_batch_of_prompts_gets_one_answer_each(router, reference, prompts):
    texts = [prompts["few"], prompts["hundred"]]
    response = router.post("/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 8,
                                                                                 "temperature": 0}})
    assert response.status_code == 200, response.text
    answers = response.json()
    assert len(answers) == 2
    for text, answer in zip(texts, answers, strict=True):
        assert_matches(answer["output_ids"], reference.greedy(text, 8), reference.eos)


def test_sixteen_concurrent_requests_all_succeed_with_the_right_tokens(cluster, reference):
    words = ["apples", "rivers", "servers", "bread", "foxes", "routers", "classes", "values", "streets", "shops",
             "dogs", "banks", "mornings", "smells", "objects", "functions"]
    texts = [f"Request number {i} asks about {word}" for i, word in enumerate(words)]
    refs = [reference.greedy(t, 8) for t in texts]

    def ask(text: str) -> httpx.Response:
        return httpx.post(f"{cluster.router_url}/generate", json=greedy_body(text, 8), timeout=300)

    with ThreadPoolExecutor(max_workers=16) as pool:
        responses = list(pool.map(ask, texts))
    assert [r.status_code for r in responses] == [200] * 16
    for response, ref in zip(responses, refs, strict=True):
        assert_matches(response.json()["output_ids"], ref, reference.eos)


def test_model_info_and_models_come_from_a_decode_worker(router):
    info = router.get("/get_model_info")
    assert info.status_code == 200 and info.json()["model_path"].endswith("tiny-llama")
    models = router.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]


@pytest.mark.parametrize("stream", [False, True])
def test_return_logprob_merges_the_prefills_input_logprobs(router, reference, prompts, stream):
    body = greedy_body(prompts["hundred"], 4, return_logprob=True, logprob_start_len=0, stream=stream)
    if stream:
        with router.stream("POST", "/generate", json=body) as response:
            first = sse_events(response)[0]
        meta = first["meta_info"]
    else:
        response = router.post("/generate", json=body)
        assert response.status_code == 200, response.text
        meta = response.json()["meta_info"]
        assert len(meta["output_token_logprobs"]) == 4
    # Computed by the prefill (the decode never sees the prompt's logits), put in front by the router.
    got = meta["input_token_logprobs"]
    want = reference.prompt_logprobs(prompts["hundred"])
    assert len(got) == meta["prompt_tokens"] == len(want) + 1
    assert got[0][0] is None
    assert [round(lp, 3) for lp, _, _ in got[1:]] == pytest.approx([round(w, 3) for w in want], abs=2e-3)
