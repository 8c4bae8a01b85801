"""The sampler's decision for the router's spans (router/tracing/spans.py), cheap for the requests it leaves out, which
may be most of them: for the SDK's samplers that decide a trace of the router's own by its id alone, the decision
without the SDK's context lookups and result objects (~2 us a request); and what a request left out carries."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from router.tracing.export import new_id

if TYPE_CHECKING:
    from router.pd.attempt import Attempt
    from router.transport.edge import Answer, StreamAnswer

RANDOM = 0x02  # W3C trace flags: the trace id is random (the SDK sets it on its own traces)


def by_trace_id(sampler: Any) -> Callable[[int], bool] | None:
    """Whether `sampler` samples a trace of the router's own (no parent), by its id, as its should_sample would
    decide (keeping the request's attributes as they are, with no tracestate), if it is one of the SDK's samplers
    that OTEL_TRACES_SAMPLER names which decide so; else None: the SDK's should_sample decides."""
    from opentelemetry.sdk.trace import sampling

    root = sampler._root if type(sampler).should_sample is sampling.ParentBased.should_sample else sampler
    if type(root).should_sample is sampling.TraceIdRatioBased.should_sample:
        bound, low = root.bound, root.TRACE_ID_LIMIT
        return lambda trace_id: trace_id & low < bound
    if type(root).should_sample is sampling.StaticSampler.should_sample:
        return (lambda _: True) if root._decision.is_sampled() else (lambda _: False)
    return None


class SampledOut:
    """A request the sampler left out: no span, and nothing current; both legs carry its `traceparent`, whose flags
    have SGLang leave its spans out too."""

    __slots__ = ("headers",)

    def __init__(self, trace_id: int, flags: int, state: str | None):
        # a third cheaper than f-string format specs (callgrind), on the path of most requests
        self.headers = {"traceparent": "00-%032x-%016x-%02x" % (trace_id, new_id(64), flags)}  # noqa: UP031
        if state:
            self.headers["tracestate"] = state

    def attempt(self, attempt: Attempt) -> Coroutine[Any, Any, Answer | StreamAnswer]:
        attempt.request.headers.update(self.headers)
        return attempt.answer()  # awaited by the caller: no coroutine of this method's own
