"""The exporter process's side of the router's spans (router/tracing/export.py): span records to what the OTEL_*
variables name. OTLP (HTTP or gRPC) gets the records encoded straight into the bytes of an ExportTraceServiceRequest:
the message the SDK's encoder makes of its spans (same fields, same attribute limits: tests/unit/
test_router_trace_otlp.py compares them), at a fraction of the CPU, as the SDK's span objects, made only to be
encoded, were most of the exporter's cost. The SDK's exporter still sends it (its retries, headers, compression,
TLS, timeout) behind the SDK's batch processor (OTEL_BSP_*). The console exporter, a debugging aid, prints the SDK's
spans, converted from the records as before (`converter`).

Imported by the exporter process only (and the tests): the router's own process never loads the SDK's exporters.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from pdcluster.common import otel

log = logging.getLogger("pdcluster.router")

Record = tuple[Any, ...]  # trace_export.RECORD
SCOPE = "pdcluster.router"
# OTLP's SpanFlags: whether the parent is remote is known (always, as the SDK's encoder says), and if it is.
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200
KNOWN = 4096  # attribute pairs kept encoded


def resource() -> Resource:
    """The router's: OTEL_SERVICE_NAME, else "router"; OTEL_RESOURCE_ATTRIBUTES."""
    return Resource.create({SERVICE_NAME: otel.service_name(os.environ, "router")})


def span_processor() -> tuple[SpanProcessor, Callable[[Record], Any]]:
    """The exporter the OTEL_* variables name, behind the SDK's batch processor (its own thread, bounded queue), and
    what each record is made before it is handed to it."""
    env = os.environ
    if (problem := otel.check(env)) is not None:
        raise ValueError(f"tracing: {problem}")
    if otel.exporter(env) == "console":
        return BatchSpanProcessor(ConsoleSpanExporter()), converter()
    protocol = otel.protocol(env)
    endpoint = otel.traces_endpoint(env, protocol)
    encode = encoder()
    if protocol == "grpc":
        exporter: Any = GrpcRecords(encode, endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    else:
        exporter = HttpRecords(encode, endpoint=endpoint)
    return RecordProcessor(exporter), lambda record: record


class RecordProcessor(BatchSpanProcessor):
    """The SDK's batch processor (OTEL_BSP_* read as it reads them) over records: every record is of a sampled span,
    so the check its on_end makes of an SDK span has nothing to do."""

    def on_end(self, span: Any) -> None:
        self._batch_processor.emit(span)


class HttpRecords(HttpExporter):
    """The SDK's OTLP/HTTP exporter, sending a batch of records encoded here."""

    def __init__(self, encode: Callable[[Sequence[Record]], bytes], **kwargs: Any):
        super().__init__(**kwargs)
        self.encode = encode

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        ok = self._client.export(self.encode(spans)).success
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE


class GrpcRecords(GrpcExporter):
    """The SDK's OTLP/gRPC exporter, sending a batch of records encoded here (its stub wants the message)."""

    def __init__(self, encode: Callable[[Sequence[Record]], bytes], **kwargs: Any):
        super().__init__(**kwargs)
        self.encode = encode

    def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
        return ExportTraceServiceRequest.FromString(self.encode(data))


def converter() -> Callable[[Record], ReadableSpan]:
    """Records to the SDK's spans as its tracer would have made them: the router's resource, its scope, the SDK's
    attribute limits."""
    scope, limits, where = InstrumentationScope(SCOPE), SpanLimits(), resource()

    def convert(record: Record) -> ReadableSpan:
        (name, kind, trace_id, span_id, parent_id, remote, flags, state, start, end, attributes, status, description,
         events) = record
        trace_state, trace_flags = TraceState.from_header([state]) if state else None, TraceFlags(flags)
        parent = SpanContext(trace_id, parent_id, remote, trace_flags, trace_state) if parent_id else None
        return ReadableSpan(
            name, SpanContext(trace_id, span_id, False, trace_flags, trace_state), parent, where,
            BoundedAttributes(limits.max_span_attributes, attributes, immutable=False,
                              max_value_len=limits.max_span_attribute_length),
            [Event(event, dict(values), at) for event, at, values in events], kind=SpanKind(kind),
            status=Status(StatusCode(status), description), start_time=start, end_time=end,
            instrumentation_scope=scope)
    return convert


# Protocol Buffers' wire format, by hand: a field's key is (number << 3) | type; 2 is length-delimited, 1 and 5 are
# 64- and 32-bit fixed, 0 a varint.
_I64, _DOUBLE = struct.Struct("<Q"), struct.Struct("<d")


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(key: int, payload: bytes) -> bytes:
    """A length-delimited field (its key's byte given)."""
    size = len(payload)
    return bytes((key, size)) + payload if size < 0x80 else bytes((key,)) + _varint(size) + payload


def _any_value(value: Any) -> bytes:
    """An AnyValue's fields (as the SDK's _encode_value); a value of no type it knows raises, as there."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if value is None:
        return b""
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join(_field(0x0A, _any_value(v)) for v in value))
    raise TypeError(f"Invalid type {type(value)} of value {value}")


def _attributes(key: int, attributes: Any, known: dict[tuple, bytes]) -> bytes:
    """Repeated KeyValue (the field's key byte given). Most pairs recur (a worker's id, a route, a status): each is
    encoded once (its value's type in its key, as True == 1); `known` is emptied when it grows past KNOWN."""
    out = []
    for name, value in attributes.items():
        kind = value.__class__
        if kind is list or kind is tuple:  # unhashable, or seldom the same
            out.append(_field(key, _field(0x0A, name.encode()) + _field(0x12, _any_value(value))))
        elif (pair := known.get((key, name, value, kind))) is not None:
            out.append(pair)
        else:
            if len(known) >= KNOWN:
                known.clear()
            pair = known[key, name, value, kind] = _field(key, _field(0x0A, name.encode())
                                                          + _field(0x12, _any_value(value)))
            out.append(pair)
    return b"".join(out)


def encoder() -> Callable[[Sequence[Record]], bytes]:
    """Records to the bytes of an ExportTraceServiceRequest: one ResourceSpans (the router's), one ScopeSpans."""
    limits, known = SpanLimits(), dict[tuple, bytes]()
    most, longest = limits.max_span_attributes, limits.max_span_attribute_length
    where = _field(0x0A, _attributes(0x0A, resource().attributes, known))
    scope = _field(0x0A, _field(0x0A, SCOPE.encode()))

    def span(record: Record) -> bytes:
        (name, kind, trace_id, span_id, parent_id, remote, _, state, start, end, attributes, status, description,
         events) = record
        dropped = 0
        if longest is not None or (most is not None and len(attributes) > most):  # as the SDK's span would hold them
            attributes = BoundedAttributes(most, attributes, max_value_len=longest)
            dropped = attributes.dropped
        out = [b"\x0a\x10", trace_id.to_bytes(16, "big"), b"\x12\x08", span_id.to_bytes(8, "big")]
        if state:
            out.append(_field(0x1A, state.encode()))
        if parent_id:
            out += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        out += (_field(0x2A, name.encode()), b"\x30", bytes((kind + 1,)),  # OTLP's kinds count from UNSPECIFIED
                b"\x39", _I64.pack(start), b"\x41", _I64.pack(end), _attributes(0x4A, attributes, known))
        if dropped:
            out += (b"\x50", _varint(dropped))
        for event, at, values in events:
            out.append(_field(0x5A, b"\x09" + _I64.pack(at) + _field(0x12, event.encode())
                              + _attributes(0x1A, values, known)))
        out.append(_field(0x7A, (_field(0x12, description.encode()) if description else b"")
                          + (b"\x18" + _varint(status) if status else b"")))
        out.append(b"\x85\x01" + struct.pack("<I", HAS_IS_REMOTE | (IS_REMOTE if parent_id and remote else 0)))
        return _field(0x12, b"".join(out))

    def encode(records: Sequence[Record]) -> bytes:
        spans = [scope]
        for record in records:
            try:
                spans.append(span(record))
            except Exception:  # one bad record costs itself only
                log.exception("a span the exporter could not encode", extra={"span": str(record[:2])})
        scope_spans = b"".join(spans)
        return _field(0x0A, where + _field(0x12, scope_spans))
    return encode
