"""The router's PD plumbing against fake SGLang workers: fields injected, streams relayed, failures contained."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from router.app import create_app
from router.config import RouterConfig
from tests.fakes import Behaviour, FakeWorker, ServerThread


@contextmanager
def cluster(prefill: FakeWorker, decode: FakeWorker, **config):
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        cfg = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "bootstrap_port": 8999}],
                           decode=[{"url": d.url}], health_interval=0.2, **config)
        router = stack.enter_context(ServerThread(create_app(cfg)))
        yield router.url


def until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


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
    assert isinstance(p_body["bootstrap_room"], int) and p_body["rid"] == "abc"


def test_sse_chunks_pass_through_as_they_arrive():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=3, chunk_delay=0.6))
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
    # Had the router buffered, the first chunk would arrive with the last (after ~1.8 s).
    assert arrivals[0][0] < 0.5 < arrivals[1][0]


def test_prefill_failure_aborts_the_decode_half_and_returns_502():
    prefill, decode = FakeWorker(Behaviour(status=500)), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode) as url:
        start = time.monotonic()
        response = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=10)
        assert time.monotonic() - start < 3
        assert until(lambda: decode.aborted)
    assert response.status_code == 502
    assert "prefill" in response.json()["error"]["message"]
    assert decode.aborted == [decode.received[0]["rid"]]


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
