"""An attempt's legs (router/tracing.py): each leg's request, sent with a `traceparent` of its own span, whose
timings and status are kept as plain values (trace_export.LEG) that the attempt's record carries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from time import time_ns
from typing import TYPE_CHECKING, Any

from pdcluster.protocol import Role
from router import trace_export
from router.trace_export import Span, new_id

if TYPE_CHECKING:
    from router.failures import HalfFailed
    from router.upstream import UpstreamClient, UpstreamResponse
    from router.workers import Worker

PREFILL, DECODE = Role.PREFILL.value, Role.DECODE.value


def message(exc: BaseException) -> str:
    return getattr(exc, "message", None) or repr(exc)


class TracedClient:
    """The attempt's view of the data plane's client: each leg's request with a `traceparent` of its own span, kept as
    plain values (trace_export.LEG) that the attempt's record carries; /abort_request calls are events of the attempt.
    Not pointing back at the attempt (which holds it), it makes no reference cycle per request."""

    def __init__(self, client: UpstreamClient, span: Span, prefill: Worker, decode: Worker, room: int | list[int]):
        self.client, self.span, self.prefill, self.decode, self.room = client, span, prefill, decode, room
        # The attempt's record waits for a prefill's answer that trails the decode's (PREFILL_GRACE at most): one
        # record, not two.
        self.legs: list[tuple] = []
        self.started = 0
        self.recorded = False
        self.decode_leg: list | None = None
        self.prefill_response: UpstreamResponse | None = None  # its status, the prefill leg's
        self.ended = False
        self.head = f"00-{span.trace_id:032x}-"  # each leg's `traceparent` but its span id
        self.tail = f"-{span.flags:02x}"

    def request(self, method: str, base_url: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                headers_timeout: float | None = None,
                on_sent: Callable[[UpstreamResponse], None] | None = None) -> Coroutine[Any, Any, UpstreamResponse]:
        """The client's request, with the leg's headers; a leg ends with the prefill half's task, or with the attempt
        (`end`). Not a coroutine of its own: each await of the leg's would pass through one more frame."""
        if path == "/abort_request":
            self.span.event("abort", {"server.address": base_url})
            return self.client.request(method, base_url, path, body, headers, headers_timeout, on_sent)
        span_id = new_id(64)
        carrier = dict(headers) if headers else {}
        carrier["traceparent"] = f"{self.head}{span_id:016x}{self.tail}"
        if self.span.state:
            carrier["tracestate"] = self.span.state
        if base_url == self.prefill.url and (task := asyncio.current_task()) is not None:  # the prefill half's task
            self.started += 1
            leg = [PREFILL, span_id, time_ns(), 0, self.prefill.worker_id, base_url, None, 0, None, False]
            task.add_done_callback(lambda done: self._prefill_done(leg, done))
            on_sent = on_sent or self._prefill_sent
        else:
            self.started += 1
            self.decode_leg = [DECODE, span_id, time_ns(), 0, self.decode.worker_id, base_url, None, 0, None, False]
        return self.client.request(method, base_url, path, body, carrier, headers_timeout, on_sent)

    def _prefill_sent(self, response: UpstreamResponse) -> None:
        self.prefill_response = response

    def _prefill_done(self, leg: list, task: asyncio.Future) -> None:
        if self.prefill_response is not None:
            leg[6] = self.prefill_response.status
        if task.cancelled():
            self._leg_ended(leg, cancelled=True)
        else:
            self._leg_ended(leg, None if (exc := task.exception()) is None else message(exc))

    def _leg_ended(self, leg: list, error: str | None = None, cancelled: bool = False) -> None:
        if leg[3]:
            return
        leg[3], leg[9] = time_ns(), cancelled
        if error is not None:
            leg[7], leg[8] = trace_export.ERROR, error
        span = self.span
        if self.recorded:  # sent after its attempt's record (a fan-out's gated prefill): a record of its own
            span.sink.add(trace_export.leg_record(span.trace_id, span.span_id, span.flags, span.state, self.room,
                                                  tuple(leg)))
            return
        self.legs.append(tuple(leg))
        if span.end_ns:  # the prefill's answer trailed the decode's
            self._record()

    def _record(self) -> None:
        if len(self.legs) == self.started:
            self.recorded = True
            self.span.record(tuple(self.legs))

    def end(self, attempt: Any, failure: HalfFailed | None = None) -> None:
        """The attempt (router.attempt's, not imported: a shorter import chain) ended, its outcome set: its span and
        the decode's leg end; its record waits for a prefill's answer that trails."""
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
        if (leg := self.decode_leg) is not None:
            if attempt.response is not None:
                leg[6] = attempt.response.status
            self._leg_ended(leg, failure.message if failure and failure.worker is self.decode else None)
        span.end_ns = time_ns()
        self._record()
