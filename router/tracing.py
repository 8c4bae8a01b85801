"""The router's OpenTelemetry spans, off unless `tracing` (router/config.py) or PDCLUSTER_TRACING turns them on (where
they go: pdcluster/otel.py). Off, nothing here runs: PdService holds None and no SDK object is made per request.

On, each PD request is a trace of its own or joins the client's (a W3C `traceparent` header):
  POST <route>   SERVER   the whole answer, a stream's too; its request id and status
    attempt      INTERNAL one per pair tried: the pair's worker ids, the bootstrap room (`bootstrap_room` as SGLang
                          writes it finds the prefill's KV transfer, a trace of its own), its outcome, retry reason
      prefill    CLIENT   the prefill's half, until its answer is read; its status
      decode     CLIENT   the decode's half, until the attempt ends (a stream's last chunk); its status
Each leg's request carries its own `traceparent` header, so SGLang's spans (`--enable-trace`) nest under the leg (how
SGLang 0.5.23 reads it: tests/unit/test_router_tracing_sglang.py); /health probes carry an unsampled one (otel.py).
Spans are made by hand: the PD routes bypass FastAPI (router/edge.py), the data plane has its own client.
Exports run in the SDK's batch thread: a slow or absent collector costs dropped spans, never a request's time.
The request's span is OpenTelemetry's current one while it is answered (a stream's until its end), so that the
router's log records about it carry its `trace_id` and `span_id` (TraceIds). A request the sampler leaves out
(OTEL_TRACES_SAMPLER, which the SDK reads) makes no other span: its legs carry its unsampled `traceparent` only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from contextvars import Token
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdcluster import otel
from router.edge import Answer, StreamAnswer
from router.failures import HalfFailed
from router.upstream import UpstreamClient, UpstreamResponse

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

    from router.attempt import Attempt
    from router.config import RouterConfig

_PROPAGATOR = TraceContextTextMapPropagator()
# The request being answered, for its attempts: in the context `start` attaches in the task that answers it (a
# fan-out's choices inherit it, router/fanout.py), so that no request object carries a field only tracing reads.
_REQUEST = otel_context.create_key("pdcluster_request_trace")


def from_config(config: RouterConfig) -> RouterTracing | None:
    return RouterTracing(span_processor()) if otel.enabled(config.tracing) else None


def current() -> RequestTrace | SampledOut | None:
    request = otel_context.get_value(_REQUEST)
    return request if isinstance(request, RequestTrace | SampledOut) else None


def span_processor() -> SpanProcessor:
    """The exporter the OTEL_* variables name, behind the SDK's batch processor (its own thread, bounded queue)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    env = os.environ
    if (problem := otel.check(env)) is not None:
        raise ValueError(f"tracing: {problem}")
    if otel.exporter(env) == "console":
        return BatchSpanProcessor(ConsoleSpanExporter())
    protocol = otel.protocol(env)
    endpoint = otel.traces_endpoint(env, protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return BatchSpanProcessor(GrpcExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://")))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    return BatchSpanProcessor(HttpExporter(endpoint=endpoint))


def sglang_room(room: int | list[int]) -> str | list[str]:
    """A bootstrap room (a batch's: one per item) as SGLang's spans write it."""
    return [hex(r) for r in room] if isinstance(room, list) else hex(room)


class TraceIds(logging.Filter):
    """The router's log records get the ids of the span current when they are made, as OpenTelemetry knows it: a
    trace found in the collector leads to its log lines, and a log line to its trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = trace.format_trace_id(context.trace_id)
            record.span_id = trace.format_span_id(context.span_id)
        return True


_LOG = logging.getLogger("pdcluster.router")  # every router module's
_TRACE_IDS = TraceIds()
# How long a router that stops waits for its last spans to leave. The SDK's exit handler never runs (uvicorn ends
# the process by the signal it caught), and it would wait 30 s on a collector that hangs: past a grace period.
FLUSH_AT_STOP = 5.0


class RouterTracing:
    """The router's tracer: its own provider (not the global one, which FastAPI and libraries would then use)."""

    def __init__(self, processor: SpanProcessor):
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider

        resource = Resource.create({SERVICE_NAME: otel.service_name(os.environ, "router")})
        self.provider = TracerProvider(resource=resource)  # flushed by `close`
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("pdcluster.router")
        _LOG.addFilter(_TRACE_IDS)

    def close(self) -> None:
        """The router stops: the spans left are sent, within FLUSH_AT_STOP; the log records are as without tracing."""
        _LOG.removeFilter(_TRACE_IDS)
        flush = threading.Thread(target=self.provider.shutdown, name="pdcluster-span-flush", daemon=True)
        flush.start()
        flush.join(FLUSH_AT_STOP)

    def start(self, headers: dict[str, str], route: str) -> Token[otel_context.Context]:
        """The request's server span, parented on the client's `traceparent` if it sent one, made current."""
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(f"POST {route}", parent, SpanKind.SERVER,
                                      {"http.request.method": "POST", "http.route": route})
        if not span.is_recording():  # sampled out (OTEL_TRACES_SAMPLER): made cheaply, as most requests may be
            return otel_context.attach(otel_context.set_value(_REQUEST, SampledOut(span)))
        request = RequestTrace(self.tracer, span)
        return otel_context.attach(otel_context.set_value(_REQUEST, request, request.context))

    def finish(self, token: Token[otel_context.Context], answer: Answer | StreamAnswer, request_id: str) -> None:
        """The answer is made: the span ends now, or with the stream (current until then: the relay logs too)."""
        request = current()
        assert request is not None  # attached by `start`, in this task
        if isinstance(request, SampledOut):
            otel_context.detach(token)
            return
        span = request.span
        span.set_attributes({"pdcluster.request_id": request_id, "http.response.status_code": answer.status})
        if answer.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        if isinstance(answer, StreamAnswer):  # closed by the edge in this task, whose context this is
            answer.close = _then(answer.close, lambda: _end(span, token))
        else:
            _end(span, token)

    def abandon(self, token: Token[otel_context.Context], exc: BaseException) -> None:
        """No answer: the client left (the task is cancelled) or the router failed; the span ends all the same."""
        if isinstance(request := current(), RequestTrace):
            if isinstance(exc, asyncio.CancelledError):
                request.span.set_attribute("pdcluster.cancelled", True)
            else:
                _failed(request.span, exc)
            request.span.end()
        otel_context.detach(token)


def _end(span: trace.Span, token: Token[otel_context.Context]) -> None:
    span.end()
    otel_context.detach(token)


def _then(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        try:
            first()
        finally:
            then()
    return both


class SampledOut:
    """A request the sampler left out: no span but the server's, which is not recorded, and nothing current; both
    legs carry its `traceparent`, whose flags have SGLang leave its spans out too."""

    def __init__(self, span: trace.Span):
        context = span.get_span_context()
        self.headers = {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"}
        if context.trace_state:
            self.headers["tracestate"] = context.trace_state.to_header()

    async def attempt(self, attempt: Attempt) -> Answer | StreamAnswer:
        attempt.request.headers.update(self.headers)
        return await attempt.answer()


class RequestTrace:
    """One request's server span and what its attempts must know of each other (why the last one failed)."""

    def __init__(self, tracer: trace.Tracer, span: trace.Span):
        self.tracer, self.span = tracer, span
        self.context = trace.set_span_in_context(span)
        self.failed: dict[int, str] = {}  # id(PdRequest) -> its last failed attempt's reason (a fan-out has several)

    async def attempt(self, attempt: Attempt) -> Answer | StreamAnswer:
        """attempt.answer() inside an attempt span, whose legs the attempt's client (`TracedClient`) traces."""
        request = attempt.request
        span = self.tracer.start_span("attempt", self.context, attributes={
            "pdcluster.attempt": request.attempt, "pdcluster.prefill": attempt.prefill.worker_id,
            "pdcluster.decode": attempt.decode.worker_id, "pdcluster.bootstrap_room": request.body["bootstrap_room"],
            "bootstrap_room": sglang_room(request.body["bootstrap_room"])})
        if (reason := self.failed.pop(id(request), None)) is not None:
            span.set_attribute("pdcluster.retry_reason", reason)
        client = TracedClient(attempt.d.client, self.tracer, span, attempt)
        attempt.d = replace(attempt.d, client=cast(UpstreamClient, client))
        token = otel_context.attach(client.context)  # what the attempt logs is the attempt span's
        try:
            answer = await attempt.answer()
        except HalfFailed as failure:
            self.failed[id(request)] = failure.message
            client.end(failure)
            raise
        except BaseException:
            client.end()
            raise
        finally:
            otel_context.detach(token)
        if isinstance(answer, StreamAnswer):
            answer.close = _then(answer.close, client.end)
        else:
            client.end()
        return answer


class TracedClient:
    """The attempt's view of the data plane's client: each leg's request in a span of its own, whose context its
    `traceparent` carries; /abort_request calls are events of the attempt."""

    def __init__(self, client: UpstreamClient, tracer: trace.Tracer, span: trace.Span, attempt: Attempt):
        self.client, self.tracer, self.span, self.attempt = client, tracer, span, attempt
        self.context = trace.set_span_in_context(span)
        self.decode_leg: trace.Span | None = None
        self.ended = False

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, *args: Any, **kwargs: Any) -> UpstreamResponse:
        attempt = self.attempt
        if path == "/abort_request":
            self.span.add_event("abort", {"server.address": base_url})
            return await self.client.request(method, base_url, path, body, headers, *args, **kwargs)
        worker = attempt.prefill if base_url == attempt.prefill.url else attempt.decode
        role = worker.role.value
        leg = self.tracer.start_span(role, self.context, SpanKind.CLIENT, {
            "pdcluster.role": role, "pdcluster.worker_id": worker.worker_id, "server.address": base_url,
            "pdcluster.bootstrap_room": attempt.request.body["bootstrap_room"]})
        carrier = dict(headers or {})
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(leg))
        try:
            response = await self.client.request(method, base_url, path, body, carrier, *args, **kwargs)
        except BaseException as exc:
            _failed(leg, exc)
            leg.end()
            raise
        leg.set_attribute("http.response.status_code", response.status)
        task = asyncio.current_task()
        if worker is attempt.prefill and task is not None:  # the prefill half's own task: it ends with the half
            task.add_done_callback(lambda done: _leg_done(leg, done))
        else:
            self.decode_leg = leg
        return response

    def end(self, failure: HalfFailed | None = None) -> None:
        """The attempt ended (its outcome is set): its span and the decode's leg end; a prefill may trail."""
        if self.ended:
            return
        self.ended = True
        span, outcome = self.span, self.attempt.outcome
        if outcome is not None:
            span.set_attribute("pdcluster.outcome", outcome.ending.value)
            failure = failure or outcome.failure
        if failure is not None:
            span.set_attributes({"pdcluster.failure": failure.message, "pdcluster.retryable": failure.retryable,
                                 "pdcluster.failed_worker": failure.worker.worker_id})
            span.set_status(Status(StatusCode.ERROR, failure.message))
        if self.decode_leg is not None:
            if failure is not None and failure.worker is self.attempt.decode:
                _failed(self.decode_leg, failure)
            self.decode_leg.end()
        span.end()


def _failed(span: trace.Span, exc: BaseException) -> None:
    span.set_status(Status(StatusCode.ERROR, getattr(exc, "message", None) or repr(exc)))


def _leg_done(leg: trace.Span, task: asyncio.Future) -> None:
    if task.cancelled():
        leg.set_attribute("pdcluster.cancelled", True)
    elif (exc := task.exception()) is not None:
        _failed(leg, exc)
    leg.end()
