"""OpenAI's `n` through the router (router/openai/fanout.py) against fake workers: n PD requests of the prompt, the
first alone, the others' decode halves at once and their prefill halves to its prefill once it answered, merged into one
answer (choice indexes, one id, the usage of the prompt once), plain and streamed; one choice failing fails the answer
cleanly and aborts the others; n bounded."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from router.app import create_app
from router.config import RouterConfig
from router.openai.openai_answer import merged_usage
from router.pd.pairing import preferred
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.helpers import until
from tests.unit.test_policies import workers
from tests.unit.test_router_pd import metric

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@contextmanager
def cluster(prefills: list[FakeWorker], decodes: list[FakeWorker], **config):
    with ExitStack() as stack:
        ps = [stack.enter_context(ServerThread(p.app())) for p in prefills]
        ds = [stack.enter_context(ServerThread(d.app())) for d in decodes]
        seeds = {"deterministic_inference": True}  # a seed is honoured exactly (tests/unit/test_seeds.py)
        cfg = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999, **seeds} for p in ps],
                           decode=[{"url": d.url, **seeds} for d in ds], health_interval=0.2, **config)
        yield stack.enter_context(ServerThread(create_app(cfg))).url


def events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]


def test_n_choices_are_n_requests_merged_into_one_answer():
    # The first choice's prompt was not cached, the later ones' was: the prompt (and its cache) is counted once,
    # as the first choice's.
    decode = FakeWorker(Behaviour(chunks=3, cached_tokens=0, per_request={
        i: Behaviour(chunks=3, cached_tokens=5) for i in (2, 3)}))
    prefill = FakeWorker()
    with cluster([prefill], [decode]) as url:
        response = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 3, "seed": 7}, timeout=30)
        assert metric(url, "pdcluster_router_requests_total", route=CHAT, status="200") == 1
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "xxx" and c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                               "prompt_tokens_details": {"cached_tokens": 0},
                               "completion_tokens_details": {"reasoning_tokens": 0}}  # where OpenAI has them
    assert answer["object"] == "chat.completion" and isinstance(answer["id"], str)
    assert len(decode.received) == len(prefill.received) == 3
    assert all("n" not in body for body in decode.received)  # each is a request for one choice
    assert len({body["rid"] for body in decode.received}) == len({b["bootstrap_room"] for b in decode.received}) == 3
    assert sorted(body["seed"] for body in decode.received) == [7, 8, 9]  # the same seed would make one choice 3 times


def test_the_first_choice_goes_alone_and_the_others_to_its_prefill_once_it_answered():
    prefills = [FakeWorker(Behaviour(delay=0.5)), FakeWorker(Behaviour(delay=0.5))]  # round robin alternates them
    decode = FakeWorker(Behaviour(delay=1.0))  # a decode answers once it has the prefill's KV
    with cluster(prefills, [decode]) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "n": 4}, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 4
    served = [p for p in prefills if p.received]
    assert len(served) == 1 and len(served[0].received) == 4  # where the prompt is cached
    arrived = served[0].received_at
    assert all(later - arrived[0] >= 0.45 for later in arrived[1:])  # after the first's prefill answered
    assert max(arrived[1:]) - min(arrived[1:]) < 0.45  # and together (one after another: 0.5 s apart each)
    # the decode halves went at once: their handshakes happen while the first is prefilled
    assert len(decode.received_at) == 4 and max(decode.received_at) - min(decode.received_at) < 0.45


def test_a_streamed_answer_relays_every_choice_then_one_usage_and_one_done():
    decode = FakeWorker(Behaviour(chunks=3, chunk_delay=0.05))
    with cluster([FakeWorker()], [decode]) as url:
        response = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}}, timeout=30)
        assert metric(url, "pdcluster_router_requests_total", route=CHAT, status="200") == 1
        assert metric(url, "pdcluster_router_request_duration_seconds_count", route=CHAT) == 1
        assert metric(url, "pdcluster_router_ttft_seconds_count", route=CHAT) == 1
    assert response.status_code == 200
    lines = events(response)
    assert lines.count("[DONE]") == 1 and lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    *content, usage = chunks
    assert len({chunk["id"] for chunk in chunks}) == 1
    by_choice: dict[int, str] = {}
    for chunk in content:
        (choice,) = chunk["choices"]
        by_choice[choice["index"]] = by_choice.get(choice["index"], "") + choice["delta"]["content"]
    assert by_choice == {0: "xxx", 1: "xxx", 2: "xxx"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    assert usage["usage"]["prompt_tokens"] == 5 and usage["usage"]["total_tokens"] == 14


def test_a_list_of_prompts_is_indexed_as_openai_does():
    """choice i of prompt j is index j * n + i (each choice's request is the whole list: one choice per prompt)."""
    decode = FakeWorker(Behaviour(per_request={1: Behaviour(tokens=["a"]), 2: Behaviour(tokens=["b"])}))
    with cluster([FakeWorker()], [decode]) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": ["p", "q"], "n": 2}, timeout=30)
    answer = response.json()
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "a"), (1, "b"), (2, "a"), (3, "b")]
    assert answer["usage"]["prompt_tokens"] == 10 and answer["usage"]["completion_tokens"] == 4


def test_one_choice_failing_fails_the_answer_and_aborts_the_others():
    # The first choice's decode and the third's hang (until aborted); the second's refuses the request.
    decode = FakeWorker(Behaviour(hang=True, per_request={2: Behaviour(status=400, error_message="bad value")}))
    prefill = FakeWorker()
    with cluster([prefill], [decode]) as url:
        response = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 3}, timeout=30)
        assert until(lambda: len(decode.aborted) == 2)
        assert metric(url, "pdcluster_router_requests_total", route=CHAT, status="400") == 1
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "bad value" in error["message"]
    assert "choices" not in response.json()
    rids = [body["rid"] for body in decode.received]
    assert sorted(decode.aborted) == sorted([rids[0], rids[2]])
    assert until(lambda: set(prefill.aborted) == set(rids))  # the failed one's prefill half too


@pytest.mark.parametrize("failing", [Behaviour(status=400, error_message="bad value"),  # before its stream
                                     Behaviour(chunks=5, chunk_delay=0.1, drop_after_chunks=1)])  # during it
def test_one_streamed_choice_failing_ends_the_stream_with_an_error_event_and_aborts_the_others(failing):
    decode = FakeWorker(Behaviour(chunks=200, chunk_delay=0.05, per_request={2: failing}))
    with cluster([FakeWorker()], [decode]) as url:
        response = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 3, "stream": True}, timeout=30)
        assert until(lambda: len(decode.aborted) == 2)
    assert response.status_code == 200
    lines = events(response)
    error = json.loads(lines[-1])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] in (400, 502)
    assert "[DONE]" not in lines  # as a stream that breaks ends
    rids = [body["rid"] for body in decode.received]
    assert sorted(decode.aborted) == sorted([rids[0], rids[2]])


def test_the_first_choice_failing_before_its_answer_is_the_answer_and_no_later_prefill_half_goes():
    decode = FakeWorker(Behaviour(status=400, error_message="bad value"))
    prefill = FakeWorker(Behaviour(delay=1.0))  # answers well after the decode's 400: the later halves' gate
    with cluster([prefill], [decode], max_attempts=1) as url:
        plain = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 3}, timeout=30)
        streamed = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 3, "stream": True}, timeout=30)
        until(lambda: len(prefill.received) >= 2)
        time.sleep(1.5)  # past the first prefill half's answer: a later half still held would go now
    assert plain.status_code == streamed.status_code == 400
    assert "bad value" in plain.json()["error"]["message"] and "bad value" in streamed.json()["error"]["message"]
    assert len(prefill.received) == 2  # the first choices' only: the later ones' were held, then dropped


@pytest.mark.parametrize(("route", "body", "limit"), [
    (CHAT, {"messages": MESSAGES, "n": 9}, "at most 8"),  # the router's max_n
    ("/v1/completions", {"prompt": "hi", "n": 65}, "less than or equal to 64"),  # the inventory's ceiling
    ("/v1/completions", {"prompt": "hi", "n": 0}, "greater than or equal to 1"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2}}, "1 only"),  # the native API: one sample
])
def test_n_out_of_bounds_is_a_400_naming_it(route, body, limit):
    decode = FakeWorker()
    with cluster([FakeWorker()], [decode]) as url:
        response = httpx.post(f"{url}{route}", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] in ("n", "sampling_params.n") and limit in error["message"], error
    assert decode.received == []


def test_max_n_is_configured():
    with cluster([FakeWorker()], [FakeWorker()], max_n=2) as url:
        assert httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 2}, timeout=30).status_code == 200
        response = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": 3}, timeout=30)
    assert response.status_code == 400 and "at most 2" in response.json()["error"]["message"]


def test_the_usage_counts_the_prompt_once_and_every_completion():
    usages = [{"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "reasoning_tokens": 1,
               "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 1}},
              {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14, "reasoning_tokens": 2,
               "prompt_tokens_details": {"cached_tokens": 8}, "completion_tokens_details": {"reasoning_tokens": 2}}]
    assert merged_usage(usages) == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                                    "reasoning_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0},
                                    "completion_tokens_details": {"reasoning_tokens": 3}}


def test_a_later_choice_keeps_to_the_first_ones_prefill_while_it_can():
    prefills, decodes = workers(0, 0), workers(0)
    assert preferred(prefills, decodes, "w1") == [prefills[1]]
    assert preferred(prefills[:1], decodes, "w1") == prefills[:1]  # gone (or tried): any
