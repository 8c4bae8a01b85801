"""The router's spans over real OTLP/HTTP (its exporter process: the SDK's BatchSpanProcessor and OTLP exporter,
configured by the OTEL_* variables) to an in-process receiver that decodes them as a collector does
(bench/harness/otlp_receiver.py), over fake workers: one trace per request with the attributes docs/operations.md
promises.
Then a collector that is down, and one that accepts and never answers: requests still answer at once, nothing piles
up, and the router still stops within its bound."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from bench.harness.otlp_receiver import Receiver, Span
from pdcluster.common import otel
from tests.fakes import Behaviour, FakeWorker
from tests.helpers import free_port, until
from tests.unit.test_router_pd import cluster
from tests.unit.test_router_processes import router_over_fakes

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
# Batches leave every 50 ms rather than the default 5 s, so a test sees its spans at once (a standard variable).
FAST_BATCHES = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch):
    """Sets the OTEL_* variables as an operator would, around FAST_BATCHES; returns the setter for the endpoint."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in FAST_BATCHES.items():
        monkeypatch.setenv(name, value)
    return lambda endpoint: monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)


def one(spans: dict[str, list[Span]], name: str) -> Span:
    (span,) = spans[name]
    return span


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_one_trace_at_the_collector_and_each_leg_carried_it(otel_env, stream):
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=3))
    with Receiver() as collector:
        otel_env(collector.endpoint)
        with cluster(prefill, decode, tracing=True) as url:
            response = httpx.post(f"{url}/generate", json={"text": "hi", "stream": stream}, headers={
                "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01", "x-request-id": "r1"})
            assert response.status_code == 200
            assert until(lambda: len(collector.spans) >= 4, 10)
        spans = collector.by_name()
    server, attempt = one(spans, "POST /generate"), one(spans, "attempt")
    p_leg, d_leg = one(spans, "prefill"), one(spans, "decode")
    assert {s.trace_id for s in (server, attempt, p_leg, d_leg)} == {CLIENT_TRACE}  # the client's trace, joined
    assert server.parent_span_id == CLIENT_PARENT and server.kind == "SERVER"
    assert attempt.parent_span_id == server.span_id and attempt.kind == "INTERNAL"
    assert {s.service for s in (server, attempt, p_leg, d_leg)} == {"router"}
    assert server.attributes["pdcluster.request_id"] == "r1"
    assert server.attributes["http.response.status_code"] == 200
    room = decode.received[0]["bootstrap_room"]
    assert attempt.attributes["pdcluster.prefill"] == "static-prefill-0"
    assert attempt.attributes["pdcluster.decode"] == "static-decode-0"
    assert attempt.attributes["pdcluster.bootstrap_room"] == room
    assert attempt.attributes["pdcluster.outcome"] == "delivered"
    for leg, worker, worker_id in ((p_leg, prefill, "static-prefill-0"), (d_leg, decode, "static-decode-0")):
        assert leg.kind == "CLIENT" and leg.parent_span_id == attempt.span_id
        assert leg.attributes["pdcluster.worker_id"] == worker_id
        assert leg.attributes["pdcluster.bootstrap_room"] == room
        assert leg.attributes["http.response.status_code"] == 200
        # What SGLang's own spans would be parented on: this leg, in this trace.
        (headers,) = worker.received_headers
        assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{leg.span_id}-01"


def timed_requests(url: str, count: int) -> list[float]:
    """`count` requests, one at a time, plain and streamed in turn; the seconds each took. Every one answers 200."""
    took = []
    with httpx.Client(timeout=30) as client:
        for i in range(count):
            started = time.monotonic()
            response = client.post(f"{url}/generate", json={"text": "hi", "stream": i % 2 == 1})
            took.append(time.monotonic() - started)
            assert response.status_code == 200, response.text
    return sorted(took)


@pytest.mark.parametrize("collector", ["down", "hanging"])
def test_a_collector_down_or_hanging_neither_slows_nor_fails_a_request(otel_env, monkeypatch, collector):
    """A small queue, so that it fills and spans are dropped while the requests go on."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16")
    with ExitStack() as stack:
        if collector == "down":
            otel_env(f"http://127.0.0.1:{free_port()}")  # nothing listens there
        else:
            otel_env(stack.enter_context(Receiver(hang=True)).endpoint)
        url = stack.enter_context(cluster(FakeWorker(), FakeWorker(Behaviour(chunks=3)), tracing=True))
        timed_requests(url, 20)  # the exporter's first attempts and its thread are under way
        threads = threading.active_count()
        took = timed_requests(url, 200)
        # Generous: a request to the fakes takes a few ms; one waiting on the collector would take its 10 s timeout.
        assert took[len(took) // 2] < 0.5 and took[-1] < 3, took[-5:]
        assert threading.active_count() <= threads + 2  # no thread, nor connection, per export or per request
        started = time.monotonic()
        stack.close()  # the router stops (its lifespan flushes what is left), then the collector
        assert time.monotonic() - started < 9


@contextmanager
def router_process(tmp_path: Path, endpoint: str, **env: str):
    """`python -m router` as users start it, tracing on, over fake workers, exporting to `endpoint`: the process."""
    environment = {**os.environ, otel.SWITCH: "", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **env}
    with router_over_fakes(tmp_path, "tracing: true\n", environment) as (proc, url):
        timed_requests(url, 50)
        yield proc


def stop(proc: subprocess.Popen) -> float:
    """SIGTERM, as compose and Kubernetes stop it: the seconds until it exited."""
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    proc.wait(timeout=60)
    return time.monotonic() - started


def test_a_router_that_stops_sends_its_last_spans_first(tmp_path):
    """uvicorn ends the process by the signal it caught, so the SDK's exit handler never runs: the spans still
    queued (a batch leaves every 5 s by default; here, every minute) are sent as the router stops, or lost."""
    with Receiver() as collector, router_process(tmp_path, collector.endpoint, OTEL_BSP_SCHEDULE_DELAY="60000") as proc:
        assert collector.count == 0  # the first batch is still waiting
        assert stop(proc) < 10
        assert collector.count == 50 * 4  # server, attempt and two legs per request


def test_a_router_stops_within_its_bound_with_a_collector_that_hangs(tmp_path):
    """The SDK would wait 30 s for its last batch; the platform's grace period may be shorter."""
    with Receiver(hang=True) as collector, router_process(tmp_path, collector.endpoint, **FAST_BATCHES) as proc:
        assert until(lambda: collector.held, 10)  # an export is stuck on the collector
        assert stop(proc) < 15, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
