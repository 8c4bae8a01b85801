"""The router's spans (router/tracing/spans.py says which) as records, and where they go: a `Span` is recorded as plain
values and, ended, handed to a sink as a tuple (RECORD).

The production sink, ExporterProcess, is a child process of the router's (multiprocessing's spawn: a fresh
interpreter, started with the router, never on a request's path). The router buffers its records and writes them in
batches (a pickled list) into a pipe it never waits on: every BATCH records, or FLUSH_EVERY seconds after the first
one. A batch the pipe has no room for (the exporter is behind, or stuck on its collector) is dropped and counted. The
child hands the records to the SDK's batch processor and the exporter the OTEL_* variables name (router/tracing/otlp.py:
OTLP's are encoded straight from the records). It ends when the router's end of the pipe closes: as the router stops
(it flushes what it holds, and waits for the child a bounded time: spans.FLUSH_AT_STOP) or dies.

The tests' sink (tests/unit/test_router_tracing.py's LocalSink) makes each record the SDK's span
(router/tracing/otlp.py's converter) in the router's process, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import multiprocessing
import os
import pickle
import select
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from random import getrandbits
from time import time_ns
from typing import Any, Protocol

log = logging.getLogger("pdcluster.router")

# A record: one ended span. Ids are ints; the parent id 0 for a root; kind a SpanKind's value, status a StatusCode's;
# state a `tracestate` header or None; times in ns since the epoch; events (name, time, attributes).
RECORD = ("name", "kind", "trace_id", "span_id", "parent_id", "parent_is_remote", "trace_flags", "trace_state",
          "start_ns", "end_ns", "attributes", "status", "status_description", "events")
Record = tuple[Any, ...]
BATCH = 256  # records per write: 64 requests' spans, ~30 KB pickled
FLUSH_EVERY = 0.25  # seconds a record may wait for its batch to fill
ERROR = 2  # StatusCode.ERROR
PIPE_SIZE = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size: ~30 batches in flight


class Sink(Protocol):
    def add(self, record: Record) -> None: ...

    def close(self, timeout: float) -> None:
        """Send what is held, then let go, within `timeout` seconds."""


def new_id(bits: int) -> int:
    return getrandbits(bits) or new_id(bits)  # 0 is the invalid id


class Span:
    """A span being recorded: what the SDK's would hold, as plain values. Ended, it is a tuple for the sink, laid out
    as RECORD says; what is set on it after that is not recorded (as the SDK would not)."""

    __slots__ = ("attributes", "description", "end_ns", "events", "flags", "kind", "name", "parent_id", "remote",
                 "sink", "span_id", "start_ns", "state", "status", "trace_id")

    def __init__(self, sink: Sink, name: str, kind: int, trace_id: int, parent_id: int, remote: bool, flags: int,
                 state: str | None, attributes: dict[str, Any]):
        self.sink, self.name, self.kind, self.trace_id, self.span_id = sink, name, kind, trace_id, new_id(64)
        self.parent_id, self.remote, self.flags, self.state = parent_id, remote, flags, state
        self.attributes = attributes
        self.start_ns, self.end_ns, self.status = time_ns(), 0, 0
        self.description: str | None = None
        self.events: tuple[tuple[str, int, dict[str, Any]], ...] = ()

    def child(self, name: str, kind: int, attributes: dict[str, Any]) -> Span:
        return Span(self.sink, name, kind, self.trace_id, self.span_id, False, self.flags, self.state, attributes)

    def set(self, key: str, value: Any) -> None:
        if not self.end_ns:
            self.attributes[key] = value

    def update(self, attributes: dict[str, Any]) -> None:
        if not self.end_ns:
            self.attributes.update(attributes)

    def error(self, description: str | None = None) -> None:
        if not self.end_ns:
            self.status, self.description = ERROR, description

    def event(self, name: str, attributes: dict[str, Any]) -> None:
        if not self.end_ns:
            self.events = (*self.events, (name, time_ns(), attributes))

    def end(self) -> None:
        if self.end_ns:
            return
        self.end_ns = time_ns()
        self.sink.add((self.name, self.kind, self.trace_id, self.span_id, self.parent_id, self.remote, self.flags,
                       self.state, self.start_ns, self.end_ns, self.attributes, self.status, self.description,
                       self.events))

    def traceparent(self, headers: dict[str, str]) -> None:
        """The W3C headers that make this span the parent of what the receiver does (what the SDK's propagator
        writes)."""
        headers["traceparent"] = f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"
        if self.state:
            headers["tracestate"] = self.state


class PipeWriter:
    """The router's end of the pipe: records buffered, written a batch at a time without ever waiting. A batch the
    pipe takes in part is finished before the next one (the child reads a stream of pickles); a batch it has no room
    for is dropped, and `dropped` told how many spans that was."""

    def __init__(self, fd: int, dropped: Callable[[int], Any], batch: int = BATCH, every: float = FLUSH_EVERY):
        self.fd, self.dropped, self.batch, self.every = fd, dropped, batch, every
        self.buffer: list[Record] = []
        self.unsent = memoryview(b"")  # the rest of a batch the pipe took in part
        self.timer: asyncio.TimerHandle | None = None
        self.broken = False
        os.set_blocking(fd, False)
        if hasattr(fcntl, "F_SETPIPE_SZ"):
            # Over the user's limit (pipe-user-pages-soft): the default 64 KiB, fewer batches in flight.
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)

    def add(self, record: Record) -> None:
        buffer = self.buffer
        buffer.append(record)
        if len(buffer) >= self.batch:
            self.flush()
        elif self.timer is None:
            self._arm()

    def _arm(self) -> None:
        try:  # noqa: SIM105 - once a batch, but contextlib.suppress would be on a request's path
            self.timer = asyncio.get_running_loop().call_later(self.every, self.flush)
        except RuntimeError:  # no event loop (a direct call): the batch size or `drain` sends them
            pass

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.buffer = self.buffer, []
        if self.unsent:
            self.unsent = self.unsent[self._write(self.unsent):]
        if batch:
            data = memoryview(b"") if self.unsent else memoryview(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
            written = self._write(data) if data else 0
            if written:
                self.unsent = data[written:]
            else:  # the exporter process is behind, or stuck: the pipe has no room
                self.dropped(len(batch))
        if self.unsent and self.timer is None:
            self._arm()

    def _write(self, data: memoryview) -> int:
        if self.broken:
            return 0
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0
        except OSError as exc:  # the exporter process is gone (EPIPE): every span from now on is dropped
            self.broken = True
            log.error("the span exporter process is gone: spans are dropped", extra={"error": repr(exc)})
            return 0

    def drain(self, deadline: float) -> None:
        """What is held, written as the pipe takes it, waiting for room until `deadline` (monotonic) at most."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        count, pending = len(self.buffer), [self.unsent]
        if self.buffer:
            pending.append(memoryview(pickle.dumps(self.buffer, pickle.HIGHEST_PROTOCOL)))
        self.buffer, self.unsent = [], memoryview(b"")
        room = select.poll()  # not select(): the pipe's fd may be past its 1024 of a process with many connections
        room.register(self.fd, select.POLLOUT)
        for data in pending:
            while data and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0 or not room.poll(left * 1000):
                    self.dropped(count)
                    return
                data = data[self._write(data):]


class ExporterProcess(PipeWriter):
    """The production sink: the exporter's child process, and the router's end of the pipe to it."""

    def __init__(self, dropped: Callable[[int], Any], log_level: str = "warning", log_json: bool = True):
        spawn = multiprocessing.get_context("spawn")
        reader, self.writer = spawn.Pipe(duplex=False)
        self.process = spawn.Process(target=serve, args=(reader, log_level, log_json), name="pdcluster-span-exporter",
                                     daemon=True)
        self.process.start()
        reader.close()  # the child's copy is the only one: the router's ending is its end of file
        super().__init__(self.writer.fileno(), dropped)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.drain(deadline)
        self.broken = True  # a span that ends from now on is dropped, never written to a closed (or reused) fd
        self.writer.close()
        self.process.join(max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():  # stuck on its collector: what it still holds is lost
            log.warning("the span exporter process did not finish in time; its last spans are lost",
                        extra={"seconds": timeout})
            self.process.kill()
            self.process.join()


def serve(reader: Connection, log_level: str, log_json: bool) -> None:
    """The exporter process: each batch from the router to the SDK's processor, until the router's end closes; then
    the processor sends what it holds (BatchSpanProcessor's shutdown). It logs as the router does (the exporter's
    complaints about its collector are the ones an operator looks for)."""
    from pdcluster.common.logs import setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the router, which closes the pipe
    setup_logging("router-exporter", log_level, json_lines=log_json)
    from router.tracing.otlp import span_processor

    processor, convert = span_processor()
    stream = os.fdopen(os.dup(reader.fileno()), "rb")
    reader.close()
    try:
        while True:
            try:
                batch = pickle.load(stream)
            except (EOFError, pickle.UnpicklingError):  # the router closed its end (or died mid-batch)
                return
            for record in batch:
                try:
                    processor.on_end(convert(record))
                except Exception:  # one bad record costs itself only
                    log.exception("a span the exporter could not convert", extra={"span": str(record[:2])})
    finally:
        processor.shutdown()
