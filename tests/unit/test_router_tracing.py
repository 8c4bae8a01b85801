"""The router's spans (router/tracing/spans.py) against fake workers: one request is a server span, an attempt span and
a span per leg, with the pair, the bootstrap room and the outcome; each leg's request carries its own `traceparent` of
the same trace; a retry is a second attempt span with the reason; the router's log lines about a request carry its trace
and span ids; tracing off makes no span, sends no header and leaves the log lines as they were."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdcluster.common import otel
from pdcluster.common.logs import JsonLineFormatter
from router.config import RouterConfig
from router.tracing import export as trace_export
from router.tracing import otlp as trace_otlp
from router.tracing import spans as tracing
from tests.fakes import Behaviour, FakeWorker
from tests.helpers import until
from tests.unit.test_router_pd import cluster

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


class LocalSink:
    """The tests' sink: each record made a span at once, with the exporter process's conversion, and handed to
    `processor` in this process (what the tests read is what the exporter process would send)."""

    def __init__(self, processor: SpanProcessor):
        self.processor, self.convert = processor, trace_otlp.converter()

    def add(self, record: tuple) -> None:
        self.processor.on_end(self.convert(record))

    def close(self, timeout: float) -> None:
        self.processor.shutdown()


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Spans land here, at once, made by the exporter process's conversion (the real sink batches them to it)."""
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "make_sink", lambda *_: LocalSink(SimpleSpanProcessor(exporter)))
    return exporter


def finished(exporter: InMemorySpanExporter, count: int) -> dict[str, list[ReadableSpan]]:
    """The spans by name once `count` have ended (a server span ends after the answer is sent)."""
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        by_name.setdefault(span.name, []).append(span)
    return by_name


def trace_id(traceparent: str) -> str:
    return traceparent.split("-")[1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_a_server_span_an_attempt_and_two_legs_and_both_workers_get_its_traceparent(spans, stream):
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=3))
    with cluster(prefill, decode, tracing=True) as url:
        response = httpx.post(f"{url}/generate", json={"text": "hi", "stream": stream},
                              headers={"traceparent": f"00-{CLIENT_TRACE}-b7ad6b7169203331-01", "x-request-id": "r1"})
        assert response.status_code == 200
        by_name = finished(spans, 4)
    (server,), (attempt,), (p_leg,), (d_leg,) = (by_name[n] for n in ("POST /generate", "attempt", "prefill", "decode"))
    assert server.context.trace_id == int(CLIENT_TRACE, 16)  # joined the client's trace
    assert server.parent is not None and server.parent.span_id == int("b7ad6b7169203331", 16)
    assert server.attributes["pdcluster.request_id"] == "r1"
    assert server.attributes["http.response.status_code"] == 200
    assert server.resource.attributes["service.name"] == "router"
    assert attempt.parent.span_id == server.context.span_id
    room = decode.received[0]["bootstrap_room"]
    assert attempt.attributes["pdcluster.prefill"] == "static-prefill-0"
    assert attempt.attributes["pdcluster.decode"] == "static-decode-0"
    assert attempt.attributes["pdcluster.bootstrap_room"] == room
    assert attempt.attributes["pdcluster.outcome"] == "delivered"
    assert "pdcluster.retry_reason" not in attempt.attributes
    for leg, worker in ((p_leg, prefill), (d_leg, decode)):
        assert leg.parent.span_id == attempt.context.span_id
        assert leg.attributes["http.response.status_code"] == 200
        assert leg.attributes["pdcluster.bootstrap_room"] == room
        (headers,) = worker.received_headers
        assert trace_id(headers["traceparent"]) == CLIENT_TRACE
        assert headers["traceparent"].split("-")[2] == f"{leg.context.span_id:016x}"  # SGLang's spans nest under it
    # The server span covers the whole answer, a stream's last chunk included.
    assert server.end_time >= d_leg.end_time


def test_a_retry_is_a_second_attempt_span_with_the_reason(spans):
    prefill = FakeWorker()
    decode = FakeWorker(Behaviour(fail_first=1))  # 503 once: retryable, before the first byte
    with cluster(prefill, decode, tracing=True, retry_backoff=0) as url:
        response = httpx.post(f"{url}/generate", json={"text": "hi"})
        assert response.status_code == 200
        by_name = finished(spans, 7)
    first, second = sorted(by_name["attempt"], key=lambda s: s.attributes["pdcluster.attempt"])
    assert first.attributes["pdcluster.outcome"] == "failed before the first byte"
    assert first.attributes["pdcluster.retryable"] is True
    assert first.status.status_code.name == "ERROR"
    assert second.attributes["pdcluster.outcome"] == "delivered"
    assert second.attributes["pdcluster.retry_reason"] == first.attributes["pdcluster.failure"]
    assert "503" in second.attributes["pdcluster.retry_reason"]
    assert len({s.context.trace_id for spans_ in by_name.values() for s in spans_}) == 1
    assert len(by_name["decode"]) == 2 and len(by_name["prefill"]) == 2


def test_a_failed_request_has_an_error_status(spans):
    prefill, decode = FakeWorker(Behaviour(status=500)), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode, tracing=True, max_attempts=1) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30).status_code == 502
        by_name = finished(spans, 4)
    (server,), (attempt,), (p_leg,) = by_name["POST /generate"], by_name["attempt"], by_name["prefill"]
    assert server.status.status_code.name == "ERROR" and server.attributes["http.response.status_code"] == 502
    assert attempt.attributes["pdcluster.failed_worker"] == "static-prefill-0"
    assert p_leg.status.status_code.name == "ERROR"


def test_tracing_off_makes_no_span_and_sends_no_traceparent(spans, monkeypatch):
    monkeypatch.delenv(otel.SWITCH, raising=False)
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"},
                          headers={"traceparent": f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"}).status_code == 200
    assert spans.get_finished_spans() == ()
    # The client's own traceparent is not passed on either: only a span of the router's would be its parent.
    assert "traceparent" not in prefill.received_headers[0] and "traceparent" not in decode.received_headers[0]


def test_the_switch_and_the_otel_variables():
    assert not otel.enabled(None, {})
    assert otel.enabled(None, {otel.SWITCH: "1"}) and otel.enabled(True, {})
    assert not otel.enabled(False, {otel.SWITCH: "1"})
    assert not otel.enabled(True, {"OTEL_TRACES_EXPORTER": "none"})
    assert otel.traces_endpoint({}, "http/protobuf") == "http://localhost:4318/v1/traces"
    assert otel.traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http/protobuf") == \
        "http://c:4318/v1/traces"
    assert otel.traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "grpc") == "http://c:4317"
    assert otel.traces_endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}, "grpc") == "http://t/x"
    assert otel.protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert otel.check({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) is not None
    assert otel.check({"OTEL_TRACES_EXPORTER": "zipkin"}) is not None


def test_the_router_refuses_variables_it_cannot_honour(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        tracing.from_config(RouterConfig(bootstrap_url=None, tracing=True))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")  # both exporters are installed
    made = tracing.from_config(RouterConfig(bootstrap_url=None, tracing=True))
    assert made is not None and isinstance(made.sink, trace_export.ExporterProcess)
    made.close()
    assert made.sink.process.exitcode == 0  # its exporter process made the gRPC exporter, and ended with the pipe


def logged(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, list[dict]]:
    """The router's JSON log lines about one request, by message, as its formatter writes them."""
    formatter = JsonLineFormatter("router")
    lines: dict[str, list[dict]] = {}
    for record in caplog.records:
        if record.name == "pdcluster.router" and getattr(record, "request_id", None) == request_id:
            line = json.loads(formatter.format(record))
            lines.setdefault(line["msg"], []).append(line)
    return lines


def test_a_traced_requests_log_lines_carry_its_trace_id_and_the_span_they_happened_in(spans, caplog):
    caplog.set_level(logging.INFO, logger="pdcluster.router")
    prefill, decode = FakeWorker(Behaviour(status=500)), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode, tracing=True, max_attempts=1) as url:
        response = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30,
                              headers={"traceparent": f"00-{CLIENT_TRACE}-b7ad6b7169203331-01", "x-request-id": "r2"})
        assert response.status_code == 502
        by_name = finished(spans, 4)
        assert until(lambda: "abort sent" in logged(caplog, "r2"))
    (server,), (attempt,) = by_name["POST /generate"], by_name["attempt"]
    lines = logged(caplog, "r2")
    for message, span in (("dispatch", server), ("attempt failed", server), ("answered", server),
                          ("abort sent", attempt)):  # the decode's abort, sent as the attempt ended
        (line,) = lines[message]
        assert line["trace_id"] == CLIENT_TRACE, message
        assert line["span_id"] == f"{span.context.span_id:016x}", message


def test_a_broken_streams_log_line_carries_its_trace_id(spans, caplog):
    """The relay runs after the route has returned its answer: the request's span is still the current one."""
    caplog.set_level(logging.INFO, logger="pdcluster.router")
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(chunks=5, drop_after_chunks=2))
    with cluster(prefill, decode, tracing=True) as url:
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}, timeout=10,
                          headers={"x-request-id": "r3"}) as response:
            assert response.status_code == 200
            response.read()
        by_name = finished(spans, 4)
    (server,) = by_name["POST /generate"]
    (line,) = logged(caplog, "r3")["stream broke"]
    assert line["trace_id"] == f"{server.context.trace_id:032x}"
    assert line["span_id"] == f"{server.context.span_id:016x}"


def test_a_client_that_leaves_still_ends_the_server_span(spans):
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(hang=True))
    with cluster(prefill, decode, tracing=True) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=1)
        by_name = finished(spans, 4)
    (server,) = by_name["POST /generate"]
    assert server.attributes["pdcluster.cancelled"] is True
    assert by_name["attempt"][0].attributes["pdcluster.outcome"] == "client gone"


def test_tracing_off_leaves_the_log_lines_as_they_were_and_makes_no_sdk_object(monkeypatch, caplog):
    monkeypatch.delenv(otel.SWITCH, raising=False)

    def refused(*_args, **_kwargs):
        raise AssertionError("an OpenTelemetry SDK object was made with tracing off")

    monkeypatch.setattr(sdk_trace.TracerProvider, "__init__", refused)
    monkeypatch.setattr(sdk_trace.Span, "__init__", refused)
    caplog.set_level(logging.INFO, logger="pdcluster.router")
    with cluster(FakeWorker(), FakeWorker()) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}, headers={"x-request-id": "r4"}).status_code == 200
    lines = logged(caplog, "r4")
    assert {"dispatch", "answered"} <= set(lines)
    assert not any("trace_id" in line or "span_id" in line for found in lines.values() for line in found)


def test_a_sampled_out_request_makes_no_span_and_its_legs_carry_an_unsampled_traceparent(spans, monkeypatch):
    """The SDK's own sampler settings: 0 of the router's own traces, all of those a client sampled."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode, tracing=True) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 200
        assert until(lambda: prefill.received_headers)  # the prefill's half may trail the answer
        assert spans.get_finished_spans() == ()
        (p_headers,), (d_headers,) = prefill.received_headers, decode.received_headers
        assert p_headers["traceparent"] == d_headers["traceparent"]  # one trace, both legs: SGLang drops both
        assert int(p_headers["traceparent"].split("-")[3], 16) & 1 == 0  # not sampled
        sampled = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
        assert httpx.post(f"{url}/generate", json={"text": "hi"}, headers={"traceparent": sampled}).status_code == 200
        assert {s.name for s in finished(spans, 4)["attempt"]} == {"attempt"}
    assert trace_id(decode.received_headers[1]["traceparent"]) == CLIENT_TRACE
