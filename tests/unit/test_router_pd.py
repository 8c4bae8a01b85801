"""The router's PD plumbing against fake SGLang workers: fields injected, streams relayed, failures contained."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.app import create_app
from router.config import RouterConfig
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.helpers import until


@contextmanager
def cluster(prefill: FakeWorker, decode: FakeWorker, **config):
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        cfg = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                           decode=[{"url": d.url}], health_interval=0.2, **config)
        router = stack.enter_context(ServerThread(create_app(cfg)))
        yield router.url




def test_both_halves_get_the_same_request_with_pd_fields_and_the_answer_is_decodes():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=5))
    with cluster(prefill, decode) as url:
        response = httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 5}},
                              headers={"x-request-id": "abc"})
    assert response.status_code == 200
    assert response.json()["output_ids"] == [0, 1, 2, 3, 4]
    assert response.headers["x-request-id"] == "abc"
    (p_body,), (d_body,) = prefill.received, decode.received
    assert p_body == d_body
    assert p_body["bootstrap_host"] == "127.0.0.1" and p_body["bootstrap_port"] == 8999
    assert isinstance(p_body["bootstrap_room"], int) and len(p_body["rid"]) == 32  # the router's rid, never a client's


def test_sse_chunks_pass_through_as_they_arrive():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=3, chunk_delay=1.0))
    arrivals = []
    with cluster(prefill, decode) as url:
        start = time.monotonic()
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data:"):
                    arrivals.append((time.monotonic() - start, line))
    assert [line for _, line in arrivals][-1] == "data: [DONE]"
    assert len(arrivals) == 4
    # Had the router buffered, every chunk would arrive at once (after ~3 s); relayed, they come ~1 s apart.
    assert arrivals[1][0] - arrivals[0][0] > 0.5 and arrivals[2][0] - arrivals[1][0] > 0.5


def test_prefill_failure_aborts_the_decode_half_and_returns_502():
    prefill, decode = FakeWorker(Behaviour(status=500)), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode, max_attempts=1) as url:
        start = time.monotonic()
        response = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30)
        assert time.monotonic() - start < 10  # the decode half would hang forever if it were not aborted
        assert until(lambda: decode.aborted)
    assert response.status_code == 502
    assert "prefill" in response.json()["error"]["message"]
    assert decode.aborted == [decode.received[0]["rid"]]


ABORTED_NATIVE = {"meta_info": {"finish_reason": {"type": "abort", "message": "Aborted by /tmp/x.py"}}}
ABORTED_CHAT = {"choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "abort"}]}


@pytest.mark.parametrize(("path", "body", "aborted"), [
    ("/generate", {"text": "hi"}, ABORTED_NATIVE),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, ABORTED_CHAT),
])
def test_a_prefill_that_answers_200_with_an_abort_fails_the_request_at_once(path, body, aborted):
    """SGLang answers 200 for an abort with no status code: the decode, left alone, would wait minutes for KV."""
    prefill, decode = FakeWorker(Behaviour(answer_fields=aborted)), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode, max_attempts=1) as url:
        start = time.monotonic()
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert time.monotonic() - start < 10
        assert until(lambda: decode.aborted)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "prefill" in message and "aborted the request" in message and "/tmp" not in message


@pytest.mark.parametrize(("behaviour", "reason"), [
    # SGLang's stream for a grammar that does not compile: an error event with code 400 in a 200
    (Behaviour(chunks=0, error_event="Failed to compile ebnf grammar: Invalid ebnf"), "Failed to compile ebnf"),
    # a grammar that admits no token: SGLang aborts with 500, the request's fault all the same
    (Behaviour(answer_fields={"meta_info": {"finish_reason": {
        "type": "abort", "status_code": 500, "message": "Grammar accept_token failed for req r with token 0"}}}),
     "grammar admits no token"),
])
def test_a_prefill_that_refuses_the_requests_grammar_inside_a_200_is_a_400_held_against_no_one(behaviour, reason):
    prefill, decode = FakeWorker(behaviour), FakeWorker(Behaviour(hang=True))
    stream = behaviour.error_event is not None
    with cluster(prefill, decode, max_attempts=2) as url:
        response = httpx.post(f"{url}/generate", json={"text": "hi", "stream": stream}, timeout=60)
        assert until(lambda: decode.aborted)
        assert metric(url, "pdcluster_router_requests_total", route="/generate", status="400") == 1
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]
    assert len(prefill.received) == 1  # not retried


def test_decode_crash_mid_stream_ends_the_stream_with_an_error_event_and_aborts_prefill():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(chunks=5, drop_after_chunks=2))
    with cluster(prefill, decode) as url:
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}, timeout=10) as response:
            events = [line for line in response.iter_lines() if line.startswith("data:")]
        assert until(lambda: prefill.aborted)
    assert len(events) == 3
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == 502 and "decode" in error["message"]


def test_client_disconnect_mid_stream_aborts_both_halves():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(chunks=100, chunk_delay=0.05))
    with cluster(prefill, decode) as url:
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}) as response:
            next(response.iter_lines())
        assert until(lambda: prefill.aborted and decode.aborted)
    assert prefill.aborted == decode.aborted == [decode.received[0]["rid"]]


def test_client_that_gives_up_on_a_non_streamed_request_aborts_both_halves():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=1.0)  # the client hangs up after 1 s
        assert until(lambda: prefill.aborted and decode.aborted, timeout=5)
    assert prefill.aborted == decode.aborted == [decode.received[0]["rid"]]


def test_total_timeout_answers_504_and_aborts_both_halves():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode, total_timeout=1.0) as url:
        start = time.monotonic()
        response = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30)
        assert time.monotonic() - start < 5
        assert until(lambda: prefill.aborted and decode.aborted, timeout=5)
    assert response.status_code == 504
    assert response.json()["error"]["message"] == "request took longer than total_timeout (1.0s)"
    assert prefill.aborted == decode.aborted == [decode.received[0]["rid"]]


def test_batch_gets_a_room_per_item():
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode) as url:
        assert httpx.post(f"{url}/generate", json={"text": ["a", "b"]}).status_code == 200
    body = decode.received[0]
    assert len(body["bootstrap_room"]) == 2 and len(body["rid"]) == 2


@pytest.mark.parametrize(
    ("content", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"text": "x" * 5000}).encode(), 413, "limit"),
    ],
)
def test_bad_bodies_never_reach_workers(content, status, fragment):
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode, max_body_bytes=4096) as url:
        response = httpx.post(f"{url}/generate", content=content)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    assert prefill.received == decode.received == []


def test_no_healthy_worker_is_a_503_and_not_ready():
    prefill, decode = FakeWorker(), FakeWorker()
    decode.healthy = False
    with cluster(prefill, decode, unhealthy_threshold=1) as url:
        assert until(lambda: httpx.get(f"{url}/ready").status_code == 503)
        response = httpx.post(f"{url}/generate", json={"text": "hi"})
        assert response.status_code == 503 and "0 decode" in response.json()["error"]["message"]
        decode.healthy = True
        assert until(lambda: httpx.get(f"{url}/ready").status_code == 200)


def test_api_key_is_required_when_configured():
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode, api_key="s3cret") as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 401
        ok = httpx.post(f"{url}/generate", json={"text": "hi"}, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def metric(url: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def test_failure_before_the_first_byte_is_retried_on_a_new_attempt():
    # The decode answers late, as a real one does: it cannot generate before the prefill's KV arrives.
    prefill, decode = FakeWorker(Behaviour(fail_first=1)), FakeWorker(Behaviour(delay=0.3))
    with cluster(prefill, decode, retry_backoff=0) as url:
        response = httpx.post(f"{url}/generate", json={"text": "hi"})
        assert response.status_code == 200
        assert metric(url, "pdcluster_router_retries_total", route="/generate") == 1
    assert len(prefill.received) == 2
    first, second = (b["rid"] for b in prefill.received)
    assert second != first and len(second) == len(first) and decode.aborted == [first]


def test_failure_after_the_first_byte_is_never_retried():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=5, drop_after_chunks=2))
    with cluster(prefill, decode) as url:
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data:")]
        assert "error" in events[-1]
        assert metric(url, "pdcluster_router_retries_total", route="/generate") == 0
    assert len(decode.received) == 1 and len(prefill.received) == 1


def test_client_errors_are_not_retried_and_keep_the_workers_reason():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(status=400))
    with cluster(prefill, decode) as url:
        response = httpx.post(f"{url}/generate", json={"text": "hi"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "decode static-decode-0 answered 400: fake failure 400"
    assert len(decode.received) == 1


def test_breaker_opens_after_failures_and_closes_after_recovery():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(status=503))
    # The cooldown must outlast three requests and a scrape even on a busy machine (make test runs this right after
    # the e2e cluster shuts down): at 0.5 s the breaker once went half-open before the refused request was sent.
    with cluster(prefill, decode, breaker_threshold=3, breaker_cooldown=3.0, max_attempts=1) as url:
        for _ in range(3):
            assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 502
        assert metric(url, "pdcluster_router_breaker_state", worker=decode_url(url), role="decode") == 2
        refused = httpx.post(f"{url}/generate", json={"text": "hi"})
        assert refused.status_code == 503 and len(decode.received) == 3  # open: no traffic at all
        decode.behaviour = Behaviour()
        time.sleep(3.1)  # cooldown over: one trial request goes through and closes the breaker
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 200
        assert metric(url, "pdcluster_router_breaker_state", worker=decode_url(url), role="decode") == 0


def decode_url(router_url: str) -> str:
    ready = httpx.get(f"{router_url}/ready").json()
    return next(w["url"] for w in ready["workers"] if w["role"] == "decode")


def test_metrics_count_exactly_the_requests_sent():
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode) as url:
        for _ in range(7):
            httpx.post(f"{url}/generate", json={"text": "hi"})
        for _ in range(2):
            httpx.post(f"{url}/generate", json={"text": 1})
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}) as response:
            list(response.iter_lines())
        assert metric(url, "pdcluster_router_requests_total", route="/generate", status="200") == 8
        assert metric(url, "pdcluster_router_requests_total", route="/generate", status="400") == 2
        assert metric(url, "pdcluster_router_ttft_seconds_count", route="/generate") == 1
        assert metric(url, "pdcluster_router_request_duration_seconds_count", route="/generate") == 10


def test_accepted_openai_fields_pass_through_to_both_halves_untouched():
    prefill, decode = FakeWorker(), FakeWorker()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5, "stop": ["\n"],
            "response_format": {"type": "json_object"}, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    with cluster(prefill, decode) as url:
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
    for received in (prefill.received[0], decode.received[0]):
        assert {k: received[k] for k in body} == body


def test_prefill_failure_on_a_kept_alive_connection_aborts_the_decode_half_too():
    # The first request opens the connections; the second goes out on kept-alive ones, where the router follows the
    # prefill's answer with callbacks instead of a task: the failure must be seen the same way.
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode, max_attempts=1) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 200
        prefill.behaviour, decode.behaviour = Behaviour(status=500), Behaviour(hang=True)
        start = time.monotonic()
        response = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30)
        assert time.monotonic() - start < 10
        assert until(lambda: decode.aborted)
    assert response.status_code == 502
    assert "prefill" in response.json()["error"]["message"]
    assert decode.aborted == [decode.received[1]["rid"]]


def test_a_stream_the_client_read_to_its_done_is_delivered_and_aborts_nothing():
    """A client that closes its connection right after `data: [DONE]` (the openai client, guidellm) got the whole
    answer, even while the decode has not closed its stream yet: nothing is aborted, and it counts as delivered."""
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=3, done_lingers=2.0))
    with cluster(prefill, decode) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True}) as response:
            lines = []
            for line in response.iter_lines():
                lines += [line] if line.startswith("data:") else []
                if line == "data: [DONE]":
                    break  # and the connection closes, as the client's does
            assert lines[-1] == "data: [DONE]" and len(lines) == 4, lines
        time.sleep(2.5)  # past the decode's own close
        assert prefill.aborted == decode.aborted == []
        assert metric(url, "pdcluster_router_aborts_sent_total", role="decode") == 0
