"""/v1/completions with echo and logprobs under PD: the prefill's prompt logprobs in front of the decode's, as SGLang
answers without PD (router/pd/echo.py); the answers below are SGLang 0.5.23's own, a prefill's and a decode's."""

import json

import httpx
import pytest

from pdcluster.common.http import ApiError
from router.checks.checked import PromptLogprobs
from router.checks.validation import check_completion
from router.pd.echo import EchoStream, merge_whole, prompt_entries
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_router_pd import cluster

# A prefill's and a decode's answers to {"prompt": "hello world", "max_tokens": 2, "echo": true, "logprobs": 1}.
PREFILL = {"choices": [{"index": 0, "text": "hello world be", "logprobs": {
    "text_offset": [-1] * 4, "token_logprobs": [None, -8.79, -4.91, -2.15], "tokens": ["<s>", "hello", " world", " be"],
    "top_logprobs": [None, {".": -2.79}, {"¿": -3.57}, {" be": -2.15}]}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
DECODE = {"choices": [{"index": 0, "text": "hello world be has", "logprobs": {
    "text_offset": [-1, -1], "token_logprobs": [-2.15, -2.23], "tokens": [" be", " has"],
    "top_logprobs": [{" be": -2.15}, {" has": -2.23}]}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def dumped(answer: dict) -> bytes:
    return json.dumps(answer).encode()


def test_the_prompt_entries_are_the_prefills_but_the_token_it_sampled():
    entries = prompt_entries(dumped(PREFILL))[0]
    assert entries["tokens"] == ["<s>", "hello", " world"]
    assert entries["token_logprobs"] == [None, -8.79, -4.91]
    assert entries["top_logprobs"] == [None, {".": -2.79}, {"¿": -3.57}]


def test_a_whole_answer_has_the_prompt_then_the_completion():
    merged = json.loads(merge_whole(dumped(DECODE), dumped(PREFILL), PromptLogprobs()))
    logprobs = merged["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<s>", "hello", " world", " be", " has"]
    assert logprobs["token_logprobs"] == [None, -8.79, -4.91, -2.15, -2.23]
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"]) == 5
    assert len(logprobs["text_offset"]) == 5
    assert merged["choices"][0]["text"] == "hello world be has" and merged["usage"]["completion_tokens"] == 2


def test_max_tokens_0_scores_the_prompt_alone():
    merged = json.loads(merge_whole(dumped(DECODE), dumped(PREFILL), PromptLogprobs(prompt_only=True)))
    choice = merged["choices"][0]
    assert choice["text"] == "hello world"
    assert choice["logprobs"]["tokens"] == ["<s>", "hello", " world"]
    assert choice["logprobs"]["token_logprobs"] == [None, -8.79, -4.91]
    assert merged["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def test_logprobs_0_has_no_top_logprobs():
    merged = json.loads(merge_whole(dumped(DECODE), dumped(PREFILL), PromptLogprobs(top=False)))
    assert merged["choices"][0]["logprobs"]["top_logprobs"] == []


def test_a_stream_gets_the_prompt_in_each_choices_first_event():
    prefill = b"data: " + dumped(PREFILL) + b"\n\ndata: [DONE]\n\n"
    stream = EchoStream(prefill, PromptLogprobs(top=False))
    first = {"choices": [{"index": 0, "text": "hello world be", "logprobs": {
        "text_offset": [-1], "token_logprobs": [-2.15], "tokens": [" be"], "top_logprobs": [{" be": -2.15}]}}]}
    second = {"choices": [{"index": 0, "text": " has", "logprobs": {
        "text_offset": [-1], "token_logprobs": [-2.23], "tokens": [" has"], "top_logprobs": [{" has": -2.23}]}}]}
    events = [json.loads(stream.event(b"data: " + dumped(e) + b"\n\n")[6:]) for e in (first, second)]
    assert events[0]["choices"][0]["logprobs"]["tokens"] == ["<s>", "hello", " world", " be"]
    assert events[1]["choices"][0]["logprobs"]["tokens"] == [" has"]
    assert [e["choices"][0]["logprobs"]["top_logprobs"] for e in events] == [[], []]
    assert stream.event(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_the_check_sends_what_sglang_needs_for_the_prompts_logprobs():
    body = {"prompt": "a", "echo": True, "logprobs": 0, "max_tokens": 0}
    assert check_completion(body).prompt_logprobs == PromptLogprobs(top=False, prompt_only=True)
    assert (body["logprobs"], body["max_tokens"]) == (1, 1)
    assert check_completion({"prompt": "a", "echo": True}).prompt_logprobs is None  # the text echoed, no logprobs


@pytest.mark.parametrize("body", [
    {"prompt": "a", "max_tokens": 0},  # SGLang refuses 0: only the prompt scored alone takes it
    {"prompt": "a", "echo": True, "max_tokens": 0},
    {"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True},
])
def test_max_tokens_0_only_scores_a_prompt_whole(body):
    with pytest.raises(ApiError) as caught:
        check_completion(body)
    assert (caught.value.status, caught.value.param) == (400, "max_tokens")


@pytest.mark.parametrize("stream", [False, True])
def test_the_router_merges_the_prefills_prompt_logprobs(stream):
    prefill = FakeWorker(Behaviour(tokens=["<s>", "he", "llo", " x"], text="hello x"))
    decode = FakeWorker(Behaviour(tokens=[" x", " y"], text="hello x y"))
    with cluster(prefill, decode) as url:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2, "echo": True,
                                                           "logprobs": 1, "stream": stream}, timeout=30)
    assert answer.status_code == 200
    if not stream:
        logprobs = answer.json()["choices"][0]["logprobs"]
    else:
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        logprobs = {"tokens": [], "text_offset": []}
        for event in events:
            for name in logprobs:
                logprobs[name] += event["choices"][0]["logprobs"][name]
    assert logprobs["tokens"] == ["<s>", "he", "llo", " x", " y"]
    if not stream:  # (the fake's stream does not echo the prompt into its first event's text, as SGLang does)
        assert logprobs["text_offset"] == [0, 0, 2, 5, 7]  # from the text's start, the prompt's included
    assert decode.received[0]["echo"] is True and prefill.received[0]["logprobs"] == 1
