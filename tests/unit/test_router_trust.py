"""The router's trust boundary, against fake SGLang workers: no request can hurt another request or a worker."""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import orjson
import psutil
import pytest

from pdcluster.common.protocol import Role
from router.app import create_app
from router.config import RouterConfig
from router.fleet.workers import CircuitBreaker, Worker, WorkerPool
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.helpers import until
from tests.unit.test_router_pd import metric

VOCAB, CONTEXT = 1000, 4096


@contextmanager
def cluster(prefill: FakeWorker, decode: FakeWorker, pool: WorkerPool | None = None, **config):
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        limits = {"vocab_size": VOCAB, "context_length": CONTEXT}
        cfg = RouterConfig(**{"bootstrap_url": None, "prefill": [{"url": p.url, "kv_bootstrap_port": 8999, **limits}],
                              "decode": [{"url": d.url, **limits}], "health_interval": 0.2, **config})
        router = stack.enter_context(ServerThread(create_app(cfg, pool)))
        yield router.url


def events(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data:")]


def test_a_client_rid_that_prefixes_another_requests_rid_aborts_only_its_own():
    """SGLang aborts every request whose rid starts with the given one: a client's "rid": "" or "2" that hangs up
    must not take other clients' streams with it."""
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(chunks=40, chunk_delay=0.05))
    with cluster(prefill, decode) as url, httpx.Client(timeout=30) as client:
        done: list[list[str]] = []
        victim = threading.Thread(target=lambda: done.append(events(client.post(
            f"{url}/generate", json={"text": "victim", "stream": True}))))
        victim.start()
        assert until(lambda: len(decode.received) == 1)
        for attacker_rid in ("", "0", "1", "2", "a", "f"):
            with client.stream("POST", f"{url}/generate", json={"text": "x", "stream": True, "rid": attacker_rid},
                               headers={"x-request-id": attacker_rid or "empty"}) as response:
                next(response.iter_lines())  # then hang up
        victim.join(30)
        assert until(lambda: len(decode.aborted) == 6)
    victim_rid = decode.received[0]["rid"]
    assert done[0][-1] == "data: [DONE]"  # the victim's stream ran to its end
    assert victim_rid not in decode.aborted and not any(victim_rid.startswith(rid) for rid in decode.aborted)
    assert sorted(decode.aborted) == sorted(body["rid"] for body in decode.received[1:])


def test_two_clients_with_the_same_request_id_are_both_served():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(delay=0.3))
    with cluster(prefill, decode) as url, httpx.Client(timeout=30) as client:
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: answers.append(client.post(
            f"{url}/generate", json={"text": "hi", "rid": "same"}, headers={"x-request-id": "same"})))
            for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["x-request-id"] for a in answers] == ["same", "same"]
    assert len({body["rid"] for body in decode.received}) == 2 and decode.aborted == []


def test_a_bad_request_id_or_rid_is_a_400():
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode) as url:
        bad_header = httpx.post(f"{url}/generate", json={"text": "hi"}, headers={"x-request-id": "x" * 200})
        bad_rid = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "rid": 5})
    assert bad_header.status_code == 400 and bad_header.json()["error"]["param"] == "X-Request-ID"
    assert len(bad_header.headers["x-request-id"]) == 32  # a fresh one, not the client's junk
    assert bad_rid.status_code == 400 and bad_rid.json()["error"]["param"] == "rid"
    assert decode.received == []


@pytest.mark.parametrize(("body", "fragment"), [
    ({"input_ids": [999999999]}, "input_ids[0] is 999999999"),
    ({"input_ids": [[1], [2, -3]], "stream": True}, "input_ids[1][1] is -3"),
    ({"input_ids": [1] * (CONTEXT + 1)}, f"context length is {CONTEXT}"),
])
def test_token_ids_out_of_the_vocabulary_never_reach_a_worker(body, fragment):
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode) as url:
        response = httpx.post(f"{url}/generate", json=body)
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": body["input_ids"]})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert completion.status_code == 400 and fragment.replace("input_ids", "prompt") in (
        completion.json()["error"]["message"])
    assert prefill.received == decode.received == []


def test_worker_ids_are_exposed_only_when_configured_and_errors_show_no_addresses():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(status=503))
    with cluster(prefill, decode, max_attempts=1) as url:
        failed = httpx.post(f"{url}/generate", json={"text": "hi"})
        decode.behaviour = Behaviour()
        ok = httpx.post(f"{url}/generate", json={"text": "hi"})
    assert failed.status_code == 502 and "127.0.0.1" not in failed.text and "http" not in failed.text
    assert "x-pdcluster-decode" not in ok.headers
    with cluster(FakeWorker(), FakeWorker(), expose_worker_ids=True) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).headers["x-pdcluster-decode"].startswith("static")


def test_a_worker_the_data_plane_cannot_reach_fails_cleanly_and_leaks_no_counter():
    """A registered https:// worker (the data plane speaks plain http) used to leave in_flight at +1 and answer 500."""
    pool = WorkerPool(make_breaker=CircuitBreaker)
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode, pool=pool, max_attempts=1) as url:
        assert until(lambda: httpx.get(f"{url}/ready").status_code == 200)
        decode.behaviour = Behaviour(hang=True)  # as a real decode does: it waits for the KV the prefill never sends
        real = next(w for w in pool.workers.values() if w.role is Role.PREFILL)
        del pool.workers[real.worker_id]
        pool.workers["tls"] = Worker("tls", Role.PREFILL, "https://127.0.0.1:1", "127.0.0.1", 8999,
                                     vocab_size=VOCAB, breaker=CircuitBreaker())
        response = httpx.post(f"{url}/generate", json={"text": "hi"})
        in_flight = {w["worker_id"]: w["in_flight"] for w in httpx.get(f"{url}/ready").json()["workers"]}
    assert response.status_code == 502 and response.json()["error"]["message"] == "prefill tls unreachable"
    assert set(in_flight.values()) == {0}


def test_a_breaker_trial_that_ends_in_a_client_error_does_not_keep_the_worker_out():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(status=503))
    with cluster(prefill, decode, breaker_threshold=1, breaker_cooldown=1.0, max_attempts=1,
                 health_interval=60) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 502  # opens the breaker
        decode.behaviour = Behaviour(status=400)
        time.sleep(1.1)
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 400  # the trial: proves nothing
        decode.behaviour = Behaviour()
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 200  # the next one is let through


def test_a_successful_health_probe_closes_a_half_open_breaker():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(status=503))
    with cluster(prefill, decode, breaker_threshold=1, breaker_cooldown=0.5, max_attempts=1) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 502
        worker = next(w["url"] for w in httpx.get(f"{url}/ready").json()["workers"] if w["role"] == "decode")
        assert until(lambda: metric(url, "pdcluster_router_breaker_state", worker=worker, role="decode") == 0)


def test_total_timeout_covers_a_stream_and_aborts_both_halves():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(chunks=1000, chunk_delay=0.05))
    with cluster(prefill, decode, total_timeout=1.5) as url:
        start = time.monotonic()
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}, timeout=30) as response:
            received = events(response)
        elapsed = time.monotonic() - start
        assert until(lambda: prefill.aborted and decode.aborted)
    assert 1.5 <= elapsed < 10 and len(received) > 2
    error = json.loads(received[-1].removeprefix("data: "))["error"]
    assert error["code"] == 504 and error["message"] == "request took longer than total_timeout (1.5s)"


def test_a_streams_first_token_has_a_deadline():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(first_chunk_delay=60))
    with cluster(prefill, decode, first_token_timeout=1.0) as url:
        start = time.monotonic()
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}, timeout=30) as response:
            received = events(response)
        assert time.monotonic() - start < 10
        assert until(lambda: prefill.aborted and decode.aborted)
    assert json.loads(received[-1].removeprefix("data: "))["error"]["message"] == (
        "no token within first_token_timeout (1.0s)")


def thread_cpu_seconds(native_id: int) -> float:
    thread = next(t for t in psutil.Process().threads() if t.id == native_id)
    return thread.user_time + thread.system_time


def test_a_huge_body_costs_little_event_loop_time_and_other_streams_go_on():
    """A body of token ids just under the default limit (16 MiB): refused on its length (the context) without
    per-token work, while a concurrent stream keeps flowing. Judged by the router thread's CPU time (its event loop's
    work), which a busy machine inflates far less than wall-clock gaps. Before the shape-only checks, such a body
    cost ~0.7 s of CPU (per-id pydantic validation, then str() of the ids for the prefix policy) on a quiet machine;
    now its JSON parse is most of its cost. A 30 MiB body is refused unparsed (413)."""
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=100, chunk_delay=0.05))
    big = orjson.dumps({"input_ids": [123] * 4_100_000})
    assert 15 * 2**20 < len(big) < 16 * 2**20
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        limits = {"vocab_size": VOCAB, "context_length": CONTEXT}
        router = stack.enter_context(ServerThread(create_app(RouterConfig(
            bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999, **limits}],
            decode=[{"url": d.url, **limits}]))))
        client = stack.enter_context(httpx.Client(base_url=router.url, timeout=120))
        received: list[str] = []

        def stream() -> None:
            with client.stream("POST", "/generate", json={"text": "s", "stream": True}) as response:
                received.extend(line for line in response.iter_lines() if line.startswith("data:"))
        streamer = threading.Thread(target=stream)
        streamer.start()
        before = thread_cpu_seconds(router.thread.native_id)
        refused = client.post("/generate", content=big, headers={"content-type": "application/json"})
        spent = thread_cpu_seconds(router.thread.native_id) - before
        too_big = client.post("/generate", content=b" " * (30 * 2**20), headers={"content-type": "application/json"})
        streamer.join(120)
    assert refused.status_code == 400 and "context length" in refused.json()["error"]["message"]
    assert spent < 0.7, f"the router spent {spent:.2f}s of CPU on one refused body"
    assert len(received) == 101 and received[-1] == "data: [DONE]"  # the concurrent stream ran to its end
    assert too_big.status_code == 413
