"""The exporter process's OTLP (router/tracing/otlp.py): records encoded straight to an ExportTraceServiceRequest are
the message the SDK's own encoder makes of the SDK's spans converted from them, for every kind of record the router
makes (a root, a client's remote parent with its tracestate, an error, an event, a batch's list of rooms) and under
attribute limits."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from router.tracing import otlp as trace_otlp
from router.tracing.request_trace import CLIENT, INTERNAL, SERVER

TRACE = 0x0AF7651916CD43DD8448EB211C80319C


def records() -> list[tuple]:
    server = ("POST /generate", SERVER, TRACE, 0xB7AD6B7169203331, 0x00F067AA0BA902B7, True, 3, "a=1,b=two",
              1_000, 9_000, {"http.request.method": "POST", "http.route": "/generate", "pdcluster.request_id": "r1",
                             "http.response.status_code": 502, "pdcluster.cancelled": False}, 2, "failed", ())
    attempt = ("attempt", INTERNAL, TRACE, 7, 0xB7AD6B7169203331, False, 3, "a=1,b=two", 2_000, 8_000,
               {"pdcluster.attempt": 0, "pdcluster.bootstrap_room": [1 << 62, 5], "bootstrap_room": ["0x1", "0x5"],
                "pdcluster.retryable": True, "pdcluster.failure": "prefill: HTTP 500 — é"}, 2, "prefill: HTTP 500",
               (("abort", 7_000, {"server.address": "http://d:1"}), ("abort", 7_500, {})))
    leg = ("prefill", CLIENT, 1, (1 << 64) - 1, 7, False, 1, None, 3_000, 4_000,
           {"pdcluster.worker_id": "p" * 300, "weight": -2.5, "n": -3, "big": 1 << 63 - 1}, 0, None, ())
    return [server, attempt, leg]


def sdk(batch: list[tuple]) -> ExportTraceServiceRequest:
    convert = trace_otlp.converter()
    return encode_spans([convert(r) for r in batch])


def test_records_encode_to_the_sdks_message():
    batch = records()
    ours = ExportTraceServiceRequest.FromString(trace_otlp.encoder()(batch))
    assert ours == sdk(batch)
    assert ours.resource_spans[0].scope_spans[0].spans[0].trace_state == "a=1,b=two"


def test_attribute_limits_are_the_sdks(monkeypatch):
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "10")
    batch = records()
    ours = ExportTraceServiceRequest.FromString(trace_otlp.encoder()(batch))
    assert ours == sdk(batch)
    assert ours.resource_spans[0].scope_spans[0].spans[2].dropped_attributes_count == 2


def test_the_grpc_exporter_sends_the_same_message(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    processor, convert = trace_otlp.span_processor()
    try:
        exporter = processor.span_exporter
        assert isinstance(exporter, trace_otlp.GrpcRecords)
        batch = [convert(r) for r in records()]
        assert exporter._translate_data(batch) == sdk(records())
    finally:
        processor.shutdown()
