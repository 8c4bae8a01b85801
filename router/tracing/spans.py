"""The router's OpenTelemetry spans, off unless `tracing` (router/config.py) or PDCLUSTER_TRACING turns them on (where
they go: pdcluster/common/otel.py). Off, nothing here runs: PdService holds None and nothing is made per request.

On, each PD request is a trace of its own or joins the client's (a W3C `traceparent` header):
  POST <route>   SERVER   the whole answer, a stream's too; its request id and status
    attempt      INTERNAL one per pair tried: the pair's worker ids, the bootstrap room (`bootstrap_room` as SGLang
                          writes it finds the prefill's KV transfer, a trace of its own), its outcome, retry reason
      prefill    CLIENT   the prefill's half, until its answer is read; its status
      decode     CLIENT   the decode's half, until the attempt ends (a stream's last chunk); its status
Each leg's request carries its own `traceparent` header, so SGLang's spans (`--enable-trace`) nest under the leg (how
SGLang 0.5.23 reads it: tests/unit/test_router_tracing_sglang.py); /health probes carry an unsampled one (otel.py).
Spans are made by hand: the PD routes bypass FastAPI (router/transport/edge.py), the data plane has its own client.

A span here is a light record (trace_export.Span, none of the SDK's locks, limits or context switches), a tuple once
ended, which the sink (router/tracing/export.py) ships to the router's exporter process to be encoded and exported: not
on the router's CPU, and a slow, hung or absent collector costs dropped spans, never a request's time
(pdcluster_router_spans_dropped_total counts the router's). The sampler the SDK makes of OTEL_TRACES_SAMPLER[_ARG]
decides once per request (router/tracing/sampling.py); a request left out costs ~1.5 µs and no record: its legs carry
its unsampled `traceparent` only. While a traced request is answered, its span is current here: the router's log records
about it carry its `trace_id` and `span_id` (TraceIds).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdcluster.common import otel
from pdcluster.common.protocol import Role
from router.pd.failures import HalfFailed
from router.tracing import export as trace_export
from router.tracing.export import Span, new_id
from router.tracing.sampling import RANDOM, SampledOut, by_trace_id
from router.transport.edge import Answer, StreamAnswer
from router.transport.upstream import UpstreamClient, UpstreamResponse

if TYPE_CHECKING:
    from router.config import RouterConfig
    from router.fleet.workers import Worker
    from router.pd.attempt import Attempt
    from router.tracing.export import Sink

_PROPAGATOR = TraceContextTextMapPropagator()
SAMPLED = 0x01  # W3C trace flags: sampled
INTERNAL, SERVER, CLIENT = SpanKind.INTERNAL.value, SpanKind.SERVER.value, SpanKind.CLIENT.value
PREFILL, DECODE = Role.PREFILL.value, Role.DECODE.value

# What the code running now is part of: the request (for its attempts) and the span its log records name. Set by
# `start` in the task answering the request (a fan-out's choices inherit it): no request has a field only for tracing.
_CURRENT: ContextVar[tuple[RequestTrace | SampledOut | None, Span | None]] = ContextVar("pdcluster_trace")
_NOTHING: tuple[None, None] = (None, None)


def exporter_process(config: RouterConfig, dropped: Callable[[int], Any]) -> Sink:
    return trace_export.ExporterProcess(dropped, config.log_level, config.log_format == "json")


make_sink = exporter_process  # `from_config`'s choice of a sink; the tests put an in-process one here


def from_config(config: RouterConfig, dropped: Callable[[int], Any] = lambda n: None) -> RouterTracing | None:
    """`dropped(n)`: n spans were dropped on their way out (a metric)."""
    if not otel.enabled(config.tracing):
        return None
    if (problem := otel.check(os.environ)) is not None:
        raise ValueError(f"tracing: {problem}")
    return RouterTracing(make_sink(config, dropped))


def current() -> RequestTrace | SampledOut | None:
    return _CURRENT.get(_NOTHING)[0]


def sglang_room(room: int | list[int]) -> str | list[str]:
    """A bootstrap room (a batch's: one per item) as SGLang's spans write it."""
    return [hex(r) for r in room] if isinstance(room, list) else hex(room)


class TraceIds(logging.Filter):
    """The router's log records get the ids of the span current when they are made: a trace found in the collector
    leads to its log lines, and a log line to its trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        span = _CURRENT.get(_NOTHING)[1]
        if span is not None:
            record.trace_id = f"{span.trace_id:032x}"
            record.span_id = f"{span.span_id:016x}"
        return True


_LOG, _TRACE_IDS = logging.getLogger("pdcluster.router"), TraceIds()  # every router module's logger
# How long a router that stops waits for its last spans to leave: past a platform's grace period, a collector that
# hangs would have the router killed.
FLUSH_AT_STOP = 5.0


class RouterTracing:
    """The router's tracing: its sampler, as the SDK would make it, and the sink its spans go to."""

    def __init__(self, sink: Sink):
        from opentelemetry.sdk.trace import sampling

        self.sink = sink
        self.sampler = sampling._get_from_env_or_default()  # the SDK's own reading of OTEL_TRACES_SAMPLER[_ARG]
        self.by_id = by_trace_id(self.sampler)
        _LOG.addFilter(_TRACE_IDS)

    def close(self) -> None:
        """The router stops: the spans left are sent, within FLUSH_AT_STOP; the log records are as without tracing."""
        _LOG.removeFilter(_TRACE_IDS)
        self.sink.close(FLUSH_AT_STOP)

    def start(self, headers: dict[str, str], route: str) -> Token:
        """The request's server span, child of the client's `traceparent` if any, made current; none if sampled out."""
        if "traceparent" not in headers and (by_id := self.by_id) is not None:  # cheaply: most may be left out
            if not by_id(trace_id := new_id(128)):  # nothing made but its traceparent (trace_sampling.py)
                return _CURRENT.set((SampledOut(trace_id, RANDOM, None), None))
            name, parent_id, remote, random, state = f"POST {route}", 0, False, RANDOM, None
            kept = {"http.request.method": "POST", "http.route": route}
        else:
            name, attributes = f"POST {route}", {"http.request.method": "POST", "http.route": route}
            trace_id, parent_id, remote, random, state, kept = self._decide(headers, name, attributes)
            if kept is None:
                return _CURRENT.set((SampledOut(trace_id, random, state), None))
        span = Span(self.sink, name, SERVER, trace_id, parent_id, remote, SAMPLED | random, state, kept)
        return _CURRENT.set((RequestTrace(span), span))

    def _decide(self, headers: dict[str, str], name: str, attributes: dict) -> tuple:
        """The SDK's sampler's decision, as for its own span: the trace's ids, flags and state, and the span's
        attributes (None: sampled out)."""
        parent_id, remote, random, context = 0, False, RANDOM, None
        if "traceparent" in headers:  # strictly parsed, as the SDK does; a malformed one starts a trace of our own
            context = _PROPAGATOR.extract(headers)
            parent = trace.get_current_span(context).get_span_context()
            if parent.is_valid:
                trace_id, parent_id, remote, random = parent.trace_id, parent.span_id, True, parent.trace_flags & RANDOM
        if not parent_id:
            trace_id = new_id(128)
        result = self.sampler.should_sample(context, trace_id, name, SpanKind.SERVER, attributes, ())
        state = result.trace_state.to_header() if result.trace_state else None
        kept = dict(result.attributes) if result.decision.is_sampled() else None
        return trace_id, parent_id, remote, random, state, kept

    def finish(self, token: Token, answer: Answer | StreamAnswer, request_id: str) -> None:
        """The answer is made: the span ends now, or with the stream (current until then: the relay logs too)."""
        span = _CURRENT.get(_NOTHING)[1]  # set by `start`, in this task
        if span is None:
            _reset(token)
            return
        span.update({"pdcluster.request_id": request_id, "http.response.status_code": answer.status})
        if answer.status >= 500:
            span.error()
        if isinstance(answer, StreamAnswer):  # closed by the edge in this task, whose context this is
            answer.close = _then(answer.close, lambda: _end(span, token))
        else:
            _end(span, token)

    def abandon(self, token: Token, exc: BaseException) -> None:
        """No answer: the client left (the task is cancelled) or the router failed; the span ends all the same."""
        if (span := _CURRENT.get(_NOTHING)[1]) is not None:
            if isinstance(exc, asyncio.CancelledError):
                span.set("pdcluster.cancelled", True)
            else:
                _failed(span, exc)
            span.end()
        _reset(token)


def _reset(token: Token) -> None:
    try:  # noqa: SIM105 - contextlib.suppress costs a request ~0.5 µs each time
        _CURRENT.reset(token)
    except (ValueError, RuntimeError):  # not this task's (a stream closed elsewhere): that context ends with its task
        pass


def _end(span: Span, token: Token) -> None:
    span.end()
    _reset(token)


def _then(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        try:
            first()
        finally:
            then()
    return both

class RequestTrace:
    """One request's server span and what its attempts must know of each other (why the last one failed)."""

    def __init__(self, span: Span):
        self.span = span
        self.failed: dict[int, str] = {}  # id(PdRequest) -> its last failed attempt's reason (a fan-out has several)

    async def attempt(self, attempt: Attempt) -> Answer | StreamAnswer:
        """attempt.answer() inside an attempt span, whose legs the attempt's client (`TracedClient`) traces."""
        request, room = attempt.request, attempt.request.body["bootstrap_room"]
        span = self.span.child("attempt", INTERNAL, {
            "pdcluster.attempt": request.attempt, "pdcluster.prefill": attempt.prefill.worker_id,
            "pdcluster.decode": attempt.decode.worker_id, "pdcluster.bootstrap_room": room,
            "bootstrap_room": sglang_room(room)})
        if (reason := self.failed.pop(id(request), None)) is not None:
            span.set("pdcluster.retry_reason", reason)
        client = TracedClient(attempt.d.client, span, attempt.prefill, attempt.decode, room)
        dispatcher = object.__new__(type(attempt.d))  # dataclasses.replace at a fifth of its cost (its __init__)
        dispatcher.__dict__.update(attempt.d.__dict__, client=cast(UpstreamClient, client))
        attempt.d = dispatcher
        token = _CURRENT.set((self, span))  # what the attempt logs is the attempt span's
        try:
            answer = await attempt.answer()
        except HalfFailed as failure:
            self.failed[id(request)] = failure.message
            client.end(attempt, failure)
            raise
        except BaseException:
            client.end(attempt)
            raise
        finally:
            _reset(token)
        if isinstance(answer, StreamAnswer):
            answer.close = _then(answer.close, lambda: client.end(attempt))
        else:
            client.end(attempt)
        return answer


class TracedClient:
    """The attempt's view of the data plane's client: each leg's request in a span of its own, whose context its
    `traceparent` carries; /abort_request calls are events of the attempt. Not pointing back at the attempt (which
    holds it), it makes no reference cycle per request."""

    def __init__(self, client: UpstreamClient, span: Span, prefill: Worker, decode: Worker, room: int | list[int]):
        self.client, self.span, self.prefill, self.decode, self.room = client, span, prefill, decode, room
        self.decode_leg: Span | None = None
        self.ended = False

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, headers_timeout: float | None = None,
                      on_sent: Callable[[UpstreamResponse], None] | None = None) -> UpstreamResponse:
        if path == "/abort_request":
            self.span.event("abort", {"server.address": base_url})
            return await self.client.request(method, base_url, path, body, headers, headers_timeout, on_sent)
        prefill = base_url == self.prefill.url
        worker, role = (self.prefill, PREFILL) if prefill else (self.decode, DECODE)
        leg = self.span.child(role, CLIENT, {"pdcluster.role": role, "pdcluster.worker_id": worker.worker_id,
                                             "server.address": base_url, "pdcluster.bootstrap_room": self.room})
        carrier = dict(headers or {})
        leg.traceparent(carrier)
        try:
            response = await self.client.request(method, base_url, path, body, carrier, headers_timeout, on_sent)
        except BaseException as exc:
            _failed(leg, exc)
            leg.end()
            raise
        leg.set("http.response.status_code", response.status)
        if prefill and (task := asyncio.current_task()) is not None:  # the prefill half's own task: it ends with it
            task.add_done_callback(lambda done: _leg_done(leg, done))
        else:
            self.decode_leg = leg
        return response

    def end(self, attempt: Attempt, failure: HalfFailed | None = None) -> None:
        """The attempt ended (its outcome is set): its span and the decode's leg end; a prefill may trail."""
        if self.ended:
            return
        self.ended = True
        span, outcome = self.span, attempt.outcome
        if outcome is not None:
            span.set("pdcluster.outcome", outcome.ending.value)
            failure = failure or outcome.failure
        if failure is not None:
            span.update({"pdcluster.failure": failure.message, "pdcluster.retryable": failure.retryable,
                         "pdcluster.failed_worker": failure.worker.worker_id})
            span.error(failure.message)
        if self.decode_leg is not None:
            if failure is not None and failure.worker is self.decode:
                _failed(self.decode_leg, failure)
            self.decode_leg.end()
        span.end()


def _failed(span: Span, exc: BaseException) -> None:
    span.error(getattr(exc, "message", None) or repr(exc))


def _leg_done(leg: Span, task: asyncio.Future) -> None:
    if task.cancelled():
        leg.set("pdcluster.cancelled", True)
    elif (exc := task.exception()) is not None:
        _failed(leg, exc)
    leg.end()
