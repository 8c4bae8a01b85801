"""An OTLP/HTTP trace receiver in a thread on 127.0.0.1: what `make bench-tracing` exports to, and what the tests read
the router's spans from. It decodes each POST /v1/traces as a real collector does (opentelemetry-proto's
ExportTraceServiceRequest), so an exporter that sends something a collector would refuse fails here too.

`hang=True` makes a collector that accepts every connection, reads the request's head and never answers: the worst
a stuck collector can do to an exporter.
"""

from __future__ import annotations

import gzip
import os
import socket
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from bench.harness.procs import HOST, free_port

_DECOMPRESS = {"gzip": gzip.decompress, "deflate": zlib.decompress}


@dataclass
class Span:
    """One received span, ids in the W3C hex form (a `traceparent` header's)."""
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    kind: str  # SERVER, CLIENT, INTERNAL...
    service: str  # its resource's service.name
    attributes: dict[str, Any] = field(default_factory=dict)
    status: str = "UNSET"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def decode(payload: bytes) -> list[Span]:
    return spans_of(ExportTraceServiceRequest.FromString(payload))


def spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(Span(
                    s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                    s.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"), str(resource.get("service.name", "")),
                    {a.key: _value(a.value) for a in s.attributes},
                    s.status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_")))
    return spans


class Receiver:
    """`with Receiver() as collector:` set OTEL_EXPORTER_OTLP_ENDPOINT to `collector.endpoint`; `collector.spans`
    holds what arrived (with keep=False, only `collector.count`: the benchmark's collector parses each message, as a
    collector would, and counts its spans). `nice`: its threads' niceness (the benchmark's, which measures a router
    on the same cores, where a collector would run elsewhere)."""

    def __init__(self, hang: bool = False, keep: bool = True, nice: int = 0):
        self.hang, self.keep, self.nice = hang, keep, nice
        self.spans: list[Span] = []
        self.count = 0  # spans received
        self.posts = 0  # export requests answered
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.held: list[socket.socket] = []  # a hanging collector's connections, closed with it
        self.server = ThreadingHTTPServer((HOST, free_port()), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.server.server_address[1]}"

    def exporter_env(self) -> dict[str, str]:
        """The OTEL_* variables an operator sets to export a router's traces here (the SDK's batching left at its
        defaults, as in production)."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_TRACES_EXPORTER": "otlp"}

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()
        for sock in self.held:
            sock.close()

    def by_name(self) -> dict[str, list[Span]]:
        with self.lock:
            found: dict[str, list[Span]] = {}
            for span in self.spans:
                found.setdefault(span.name, []).append(span)
            return found

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if receiver.hang:
                    receiver.held.append(self.connection)
                    receiver.closing.wait()
                    return
                if receiver.nice:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), receiver.nice)
                payload = self.rfile.read(int(self.headers.get("content-length") or 0))
                encoding = self.headers.get("content-encoding")
                message = ExportTraceServiceRequest.FromString(
                    _DECOMPRESS[encoding](payload) if encoding in _DECOMPRESS else payload)
                spans = spans_of(message) if receiver.keep else []
                count = sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)
                with receiver.lock:
                    receiver.count += count
                    receiver.posts += 1
                    receiver.spans.extend(spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args) -> None:  # one line per export on stderr is noise
                pass

        return Handler
