"""Where the router's span records go (router/tracing/export.py): a pipe the router never waits on, whose full buffer
costs a counted batch, never a request's time, and never leaves half a batch in the stream; an exporter process that
ends with the router's end of the pipe, the router dying included; and a request the sampler leaves out, which makes
no record at all; nor does a traced one make the SDK's spans in the router."""

from __future__ import annotations

import fcntl
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.tracing import export as trace_export
from router.tracing import spans as tracing
from router.tracing.request_trace import CLIENT
from tests.fakes import FakeWorker
from tests.helpers import free_port, until
from tests.unit.test_router_pd import cluster
from tests.unit.test_router_tracing import LocalSink

ROOT = Path(__file__).resolve().parents[2]


def record(i: int) -> tuple:
    """A record as Span.end makes it, made big (a long attribute) so that a few fill a pipe."""
    return ("decode", CLIENT, 1 << 100, i + 1, 7, False, 3, None, 1, 2, {"pad": f"{i:x<2000}", "i": i}, 0, None,
            ())


def read_batches(fd: int, into: list[list[tuple]]) -> None:
    """Every batch that comes through the pipe until its writer closes: a stream of whole pickles, or this fails."""
    with os.fdopen(fd, "rb") as stream:
        while True:
            try:
                into.append(pickle.load(stream))
            except EOFError:
                return


def test_a_full_pipe_drops_a_batch_counts_it_and_never_waits():
    reader, writer = os.pipe()
    dropped: list[int] = []
    pipe = trace_export.PipeWriter(writer, dropped.append, batch=4)
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)  # one page: less than a batch fills it
    started = time.monotonic()
    for i in range(402):  # nobody reads: the pipe fills at once
        pipe.add(record(i))
    assert time.monotonic() - started < 1  # ~100 writes that found no room, none waited for it
    assert len(dropped) > 90 and set(dropped) == {4}  # whole batches, counted in spans
    assert pipe.unsent and len(pipe.buffer) == 2  # the first batch, in part; the last records, not a batch yet
    batches: list[list[tuple]] = []
    reading = threading.Thread(target=read_batches, args=(reader, batches))
    reading.start()  # the exporter process catches up
    pipe.drain(time.monotonic() + 5)  # the router stops: the rest of the batch in part, then what is held
    os.close(writer)
    reading.join(5)
    delivered = [r[10]["i"] for batch in batches for r in batch]
    assert delivered[:4] == [0, 1, 2, 3] and delivered[-2:] == [400, 401]
    assert len(delivered) + sum(dropped) == 402  # every record either arrived whole or was counted


def test_a_drain_that_finds_no_room_gives_up_at_its_deadline_and_counts_what_it_held():
    reader, writer = os.pipe()
    dropped: list[int] = []
    pipe = trace_export.PipeWriter(writer, dropped.append, batch=1000)
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)
    os.write(writer, b"x" * 4096)  # full
    for i in range(3):
        pipe.add(record(i))
    started = time.monotonic()
    pipe.drain(time.monotonic() + 0.3)
    assert 0.25 < time.monotonic() - started < 2 and dropped == [3]
    os.close(reader)
    os.close(writer)


def exporter_pid(router: subprocess.Popen) -> int:
    assert router.stdout is not None
    return int(router.stdout.readline())


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["closed", "killed"])
def test_the_exporter_process_ends_with_the_routers_end_of_the_pipe(how):
    """A router (here a bare process holding an ExporterProcess) whose end of the pipe closes, or that is killed:
    its exporter process ends by itself; it holds no span, so it ends at once."""
    script = ("import os, sys, time; from router.tracing.export import ExporterProcess\n"
              "sink = ExporterProcess(print); print(sink.process.pid, flush=True)\n"
              f"{'sink.writer.close()' if how == 'closed' else ''}\n"
              "time.sleep(60)\n")
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # nothing listens: never asked
    router = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE)
    try:
        pid = exporter_pid(router)
        if how == "killed":
            assert until(lambda: not gone(pid), 5)
            router.send_signal(signal.SIGKILL)
        assert until(lambda: gone(pid), 30), f"the exporter process outlived its router's end of the pipe ({how})"
    finally:
        router.kill()
        router.wait()


class Records:
    def __init__(self) -> None:
        self.records: list[tuple] = []

    def add(self, record: tuple) -> None:
        self.records.append(record)

    def close(self, timeout: float) -> None:
        pass


def test_a_sampled_out_request_makes_no_record_and_no_span(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    sink = Records()
    monkeypatch.setattr(tracing, "make_sink", lambda *_: sink)

    def refused(*_args, **_kwargs):
        raise AssertionError("a span was made for a request the sampler left out")

    monkeypatch.setattr(trace_export.Span, "__init__", refused)
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode, tracing=True) as url:
        for stream in (False, True):
            assert httpx.post(f"{url}/generate", json={"text": "hi", "stream": stream}).status_code == 200
        assert until(lambda: len(prefill.received_headers) == 2)
    assert sink.records == []
    assert all(h["traceparent"].endswith("-02") for h in prefill.received_headers + decode.received_headers)


def test_a_traced_request_makes_none_of_the_sdks_spans_in_the_router(monkeypatch):
    """The SDK's span (its locks, its attribute limits) is what tracing cost the router most: only its read-only
    form is made, of the records, and in the exporter process (here LocalSink stands for it)."""
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "make_sink", lambda *_: LocalSink(SimpleSpanProcessor(exporter)))

    def refused(*_args, **_kwargs):
        raise AssertionError("the router made an SDK span")

    monkeypatch.setattr(sdk_trace.Span, "__init__", refused)
    with cluster(FakeWorker(), FakeWorker(), tracing=True) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 200
        assert until(lambda: len(exporter.get_finished_spans()) == 4)
