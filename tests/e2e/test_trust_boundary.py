"""No request can hurt another request or a worker: hostile input against a real SGLang cluster.

Each hostile request gets a 4xx naming the problem, and the cluster serves a normal request right after it (before
these checks, one out-of-vocabulary id crashed SGLang's scheduler and the router answered 503 to everyone)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.e2e.prompts import prompt_of_about
from tests.helpers import listing

VOCAB = 1000  # scripts/build_demo_model.py


def serves_normally(router) -> None:
    response = router.post("/generate", json={"text": "Still fine?",
                                              "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 4, response.text


HOSTILE = [
    pytest.param("/generate", {"input_ids": [999999999]}, 400, "input_ids[0] is 999999999", id="huge-id"),
    pytest.param("/generate", {"input_ids": [5, -1]}, 400, "input_ids[1] is -1", id="negative-id"),
    pytest.param("/generate", {"input_ids": [5, VOCAB]}, 400, f"input_ids[1] is {VOCAB}", id="vocab-size-id"),
    pytest.param("/generate", {"input_ids": [[5, 6], [7, VOCAB + 5]]}, 400, "input_ids[1][1]", id="batch-id"),
    pytest.param("/generate", {"input_ids": [VOCAB * 3], "stream": True}, 400, "input_ids[0]", id="streamed-id"),
    pytest.param("/generate", {"input_ids": [1] * 100_000}, 400, "context length", id="over-context"),
    pytest.param("/v1/completions", {"model": "tiny-llama", "prompt": [5, 2**31]}, 400, "prompt[1]",
                 id="completion-token-prompt"),
    pytest.param("/v1/completions", {"model": "tiny-llama", "prompt": [[5], [-2]]}, 400, "prompt[1][0]",
                 id="completion-token-batch"),
    pytest.param("/generate", {"text": "a", "sampling_params": {"logit_bias": {str(VOCAB + 7): 1.0}}}, 400,
                 "logit_bias", id="logit-bias"),
    pytest.param("/generate", {"text": "a", "return_logprob": True, "token_ids_logprob": [VOCAB * 9]}, 400,
                 "token_ids_logprob", id="token-ids-logprob"),
    # Each of these took a worker down before the inventory (router/checks/inventory/): found by hand or by the fuzzer.
    pytest.param("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 4,
                                                                "stop_token_ids": [5000]}}, 400,
                 "sampling_params.stop_token_ids[0] is 5000", id="stop-token-ids-with-min-new-tokens"),
    pytest.param("/generate", {"text": "a", "sampling_params": {"top_k": 2**63 - 1}}, 400, "top_k", id="top-k-2**63"),
    pytest.param("/generate", {"text": "a", "return_logprob": True, "logprob_start_len": -5}, 400,
                 "logprob_start_len", id="negative-logprob-start"),
    pytest.param("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 2000}, 400,
                 "top_logprobs_num", id="top-logprobs-over-vocab"),
    pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                                          "top_logprobs": 10**9}, 400, "top_logprobs", id="chat-top-logprobs"),
    pytest.param("/v1/completions", {"prompt": "a", "max_tokens": 4, "top_k": 2, "repetition_penalty": 1e-300,
                                     "stream": True}, 400, "repetition_penalty", id="tiny-repetition-penalty"),
    pytest.param("/generate", {"input_ids": [5, 6, 7], "sampling_params": [{"max_new_tokens": 4}]}, 400,
                 "sampling_params", id="list-of-one-sampling-params"),
    pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                          "chat_template_kwargs": {"add_generation_prompt": 5}}, 400,
                 "chat_template_kwargs", id="chat-template-kwargs"),
    pytest.param("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "n": None}}, 200, "",
                 id="null-n"),
    # An empty item of a batch is a 0-token prefill: it killed SGLang's prefill scheduler, then the decode.
    pytest.param("/v1/completions", {"model": "tiny-llama", "prompt": ["a", ""], "max_tokens": 2}, 400,
                 "prompt[1] is empty", id="empty-prompt-item"),
    pytest.param("/generate", {"text": ["a", ""]}, 400, "text[1]", id="empty-text-item"),
    pytest.param("/generate", {"input_ids": [[5], []]}, 400, "input_ids[1]", id="empty-ids-item"),
    pytest.param("/v1/completions", {"model": "tiny-llama", "prompt": "a", "max_tokens": 0}, 400, "max_tokens",
                 id="completion-max-tokens-0"),
    # SGLang answers 500 for a grammar that admits no token: the request's fault (400), not the worker's.
    pytest.param("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 4, "ebnf": "root ::= root"}}, 400,
                 "grammar admits no token", id="empty-grammar"),
    # Sampled (min_p), the same grammar made every probability NaN: torch.multinomial raised and killed the prefill.
    pytest.param("/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "ebnf": "root ::= root", "min_p": 0.1}}, 400, "grammar admits no token",
        id="empty-grammar-sampled"),
    # A dead end after one token, on the decode. Every logit masked, the token is drawn evenly, so it could be EOS,
    # which ends the answer before the grammar is asked: ignore_eos makes the grammar refuse it every time.
    pytest.param("/v1/completions", {"model": "tiny-llama", "prompt": "a", "max_tokens": 4, "top_k": 5,
                                      "ignore_eos": True, "ebnf": 'root ::= "a" x\nx ::= x'}, 400,
                 "grammar admits no token", id="grammar-dead-after-a-token-sampled"),
]


@pytest.mark.parametrize(("path", "body", "status", "fragment"), HOSTILE)
def test_hostile_input_is_refused_and_the_cluster_goes_on(router, path, body, status, fragment):
    response = router.post(path, json=body)
    assert response.status_code == status, response.text
    if status != 200:
        assert fragment in response.json()["error"]["message"]
    serves_normally(router)


def test_the_largest_answer_the_router_accepts_is_served(cluster, router, reference):
    """The worst accepted count: every token of the context. Streamed, so that no read waits for all of it."""
    prompt, context = "Still fine?", listing(cluster, "decode")[0]["registration"]["context_length"]
    room = context - len(reference.tokenizer(prompt)["input_ids"])
    with router.stream("POST", "/generate", json={"text": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": room, "ignore_eos": True, "temperature": 0}}, timeout=300) as response:
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert response.status_code == 200 and events[-1] == "data: [DONE]"
    meta = json.loads(events[-2].removeprefix("data: "))["meta_info"]
    # SGLang keeps a few tokens of the context for itself (its prompt count includes them): a whole context, less those.
    assert room - 8 <= meta["completion_tokens"] <= room and meta["finish_reason"]["type"] == "length", meta
    too_many = router.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": context + 1}})
    assert too_many.status_code == 400 and "context length" in too_many.json()["error"]["message"]
    serves_normally(router)


def test_a_client_rid_that_prefixes_a_victims_rid_cannot_abort_it(cluster, router):
    """SGLang aborts every request whose rid starts with the given one. Attackers send rids "" and "0".."f" and
    hang up mid-stream; the victim's stream must still run to its end."""
    victim: list[str] = []

    def run_victim() -> None:
        with httpx.Client(base_url=cluster.router_url, timeout=120) as client, client.stream(
                "POST", "/generate", json={"text": "victim", "stream": True,
                                           "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                               "ignore_eos": True}}) as response:
            victim.extend(line for line in response.iter_lines() if line.startswith("data:"))
    thread = threading.Thread(target=run_victim)
    thread.start()
    time.sleep(0.5)
    for rid in ["", *"0123456789abcdef"]:
        with httpx.Client(base_url=cluster.router_url, timeout=60) as client, client.stream(
                "POST", "/generate", json={"text": "attacker", "stream": True, "rid": rid,
                                           "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}},
                headers={"x-request-id": rid or "x"}) as response:
            next(response.iter_lines())
    thread.join(120)
    assert victim[-1] == "data: [DONE]", victim[-3:]
    assert '"error"' not in "".join(victim)
    serves_normally(router)


def test_two_clients_with_the_same_request_id_are_both_served(cluster):
    answers: list[httpx.Response] = []

    def ask(i: int) -> None:
        with httpx.Client(base_url=cluster.router_url, timeout=120) as client:
            answers.append(client.post("/generate", headers={"x-request-id": "dup"},
                                       json={"text": f"twin {i}", "sampling_params": {"max_new_tokens": 16}}))
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert {a.headers["x-request-id"] for a in answers} == {"dup"}


def test_answers_over_a_mebibyte_arrive_whole_and_quickly(router, reference):
    """A non-streamed batch with top logprobs (~2+ MB from the decode), and a prefill answer with the input
    logprobs of a long prompt (>1 MiB from the prefill, merged by the router): both used to stall for
    read_timeout (the data plane stopped reading above 1 MiB) and then eject a healthy worker."""
    batch = {"text": [f"batch item {i}" for i in range(8)], "return_logprob": True, "top_logprobs_num": 20,
             "sampling_params": {"max_new_tokens": 320, "temperature": 0, "ignore_eos": True}}
    start = time.monotonic()
    response = router.post("/generate", json=batch, timeout=300)
    assert response.status_code == 200, response.text[:300]
    assert len(response.content) > 1024 * 1024
    assert all(len(item["meta_info"]["output_top_logprobs"]) == 320 for item in response.json())
    long_prompt = prompt_of_about(reference.tokenizer, 1500)
    merged = router.post("/generate", timeout=300, json={
        "text": long_prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert merged.status_code == 200, merged.text[:300]
    assert len(merged.json()["meta_info"]["input_top_logprobs"]) >= 1400
    big_ones = time.monotonic() - start
    assert big_ones < 120, f"{big_ones:.0f}s for two large answers"
    small = time.monotonic()
    serves_normally(router)
    assert time.monotonic() - small < 30
