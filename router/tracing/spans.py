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

A span here is a light record (router/tracing/export.py's Span, none of the SDK's locks, limits or context switches), a
tuple once ended, which the sink (router/tracing/export.py) ships to the router's exporter process to be encoded and
exported: not on the router's CPU, and a slow, hung or absent collector costs dropped spans, never a request's time
(pdcluster_router_spans_dropped_total counts the router's). The sampler the SDK makes of OTEL_TRACES_SAMPLER[_ARG]
decides once per request (router/tracing/sampling.py); a request left out costs ~1.5 µs and no record: its legs carry
its unsampled `traceparent` only. While a traced request is answered, its span is current here: the router's log records
about it carry its `trace_id` and `span_id` (TraceIds). What a request's trace holds while it runs, its attempts' spans
and their legs': router/tracing/request_trace.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from contextvars import Token
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdcluster.common import otel
from router.tracing import export as trace_export
from router.tracing.export import Span, new_id
from router.tracing.request_trace import (
    CURRENT,
    NOTHING,
    SERVER,
    RequestTrace,
    TraceIds,
    chained,
    current,
    failed,
    reset,
)
from router.tracing.sampling import RANDOM, SampledOut, by_trace_id
from router.transport.edge import Answer, StreamAnswer

if TYPE_CHECKING:
    from router.config import RouterConfig
    from router.tracing.export import Sink

__all__ = ["FLUSH_AT_STOP", "RouterTracing", "current", "from_config", "make_sink"]  # current: PdService reads it here

_PROPAGATOR = TraceContextTextMapPropagator()
SAMPLED = 0x01  # W3C trace flags: sampled


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
            if not by_id(trace_id := new_id(128)):  # nothing made but its traceparent (sampling.py)
                return CURRENT.set((SampledOut(trace_id, RANDOM, None), None))
            name, parent_id, remote, random, state = f"POST {route}", 0, False, RANDOM, None
            kept = {"http.request.method": "POST", "http.route": route}
        else:
            name, attributes = f"POST {route}", {"http.request.method": "POST", "http.route": route}
            trace_id, parent_id, remote, random, state, kept = self._decide(headers, name, attributes)
            if kept is None:
                return CURRENT.set((SampledOut(trace_id, random, state), None))
        span = Span(self.sink, name, SERVER, trace_id, parent_id, remote, SAMPLED | random, state, kept)
        return CURRENT.set((RequestTrace(span), span))

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
        span = CURRENT.get(NOTHING)[1]  # set by `start`, in this task
        if span is None:
            reset(token)
            return
        span.update({"pdcluster.request_id": request_id, "http.response.status_code": answer.status})
        if answer.status >= 500:
            span.error()
        if isinstance(answer, StreamAnswer):  # closed by the edge in this task, whose context this is
            answer.close = chained(answer.close, lambda: _end(span, token))
        else:
            _end(span, token)

    def abandon(self, token: Token, exc: BaseException) -> None:
        """No answer: the client left (the task is cancelled) or the router failed; the span ends all the same."""
        if (span := CURRENT.get(NOTHING)[1]) is not None:
            if isinstance(exc, asyncio.CancelledError):
                span.set("pdcluster.cancelled", True)
            else:
                failed(span, exc)
            span.end()
        reset(token)


def _end(span: Span, token: Token) -> None:
    span.end()
    reset(token)
