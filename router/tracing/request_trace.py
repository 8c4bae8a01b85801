"""One traced request while it is answered: its trace (`RequestTrace`), the span of each attempt and of each leg of an
attempt (`TracedClient`), and what is current in the task answering it (a ContextVar: the request's trace and the span
the router's log records name, `TraceIds`). router/tracing/spans.py decides whether a request is traced, and starts and
ends its server span; what the spans are: its docstring."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, cast

from opentelemetry.trace import SpanKind

from pdcluster.common.protocol import Role
from router.pd.failures import HalfFailed
from router.tracing.export import Span
from router.tracing.sampling import SampledOut
from router.transport.edge import Answer, StreamAnswer
from router.transport.upstream import UpstreamClient, UpstreamResponse

if TYPE_CHECKING:
    from router.fleet.workers import Worker
    from router.pd.attempt import Attempt

INTERNAL, SERVER, CLIENT = SpanKind.INTERNAL.value, SpanKind.SERVER.value, SpanKind.CLIENT.value
PREFILL, DECODE = Role.PREFILL.value, Role.DECODE.value


# What the code running now is part of: the request (for its attempts) and the span its log records name. Set by
# RouterTracing.start (router/tracing/spans.py) in the task answering the request (a fan-out's choices inherit it): no
# request has a field only for tracing.
CURRENT: ContextVar[tuple[RequestTrace | SampledOut | None, Span | None]] = ContextVar("pdcluster_trace")
NOTHING: tuple[None, None] = (None, None)


def current() -> RequestTrace | SampledOut | None:
    return CURRENT.get(NOTHING)[0]


def sglang_room(room: int | list[int]) -> str | list[str]:
    """A bootstrap room (a batch's: one per item) as SGLang's spans write it."""
    return [hex(r) for r in room] if isinstance(room, list) else hex(room)


class TraceIds(logging.Filter):
    """The router's log records get the ids of the span current when they are made: a trace found in the collector
    leads to its log lines, and a log line to its trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        span = CURRENT.get(NOTHING)[1]
        if span is not None:
            record.trace_id = f"{span.trace_id:032x}"
            record.span_id = f"{span.span_id:016x}"
        return True


def reset(token: Token) -> None:
    """What was current before `token`'s set is again, in the task that set it."""
    try:  # noqa: SIM105 - contextlib.suppress costs a request ~0.5 µs each time
        CURRENT.reset(token)
    except (ValueError, RuntimeError):  # not this task's (a stream closed elsewhere): that context ends with its task
        pass


def chained(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """`first`, then `then` even if `first` raised (a stream's close, then what ends with it)."""
    def both() -> None:
        try:
            first()
        finally:
            then()
    return both


def failed(span: Span, exc: BaseException) -> None:
    span.error(getattr(exc, "message", None) or repr(exc))


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
        token = CURRENT.set((self, span))  # what the attempt logs is the attempt span's
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
            reset(token)
        if isinstance(answer, StreamAnswer):
            answer.close = chained(answer.close, lambda: client.end(attempt))
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
            failed(leg, exc)
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
                failed(self.decode_leg, failure)
            self.decode_leg.end()
        span.end()


def _leg_done(leg: Span, task: asyncio.Future) -> None:
    if task.cancelled():
        leg.set("pdcluster.cancelled", True)
    elif (exc := task.exception()) is not None:
        failed(leg, exc)
    leg.end()
