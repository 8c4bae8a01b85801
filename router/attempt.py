"""One attempt of a request on one PD pair, from sending its halves to its end: the single owner of everything the
attempt holds, as nano-vllm's `Sequence` is owned by one scheduler.

It holds the pair's books (in flight on both workers, each breaker's trial), the prefill half (its answer, its prompt
tokens on the worker's books), the decode's response and, for a stream, the deadline timers. `end()` gives all of it
back, once, whatever ends the attempt:

  - the answer was delivered (a plain answer read, a stream relayed to its last chunk);
  - a half failed (before the answer: the caller may retry on a new pair; mid-stream: an error event);
  - the client left, total_timeout passed, or the edge closed a stream whose relay never began.

A second `end()` does nothing, so every path that may end an attempt just calls it. Which halves are aborted is
failures.halves_to_abort's decision: the other half of one that failed, both when the router ended the attempt.
"""

from __future__ import annotations

import asyncio
import json  # on the rare paths (logprob merge, error events), as logprobs.py: it accepts NaN/Infinity, orjson not
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

import orjson

from pdcluster.http import error_body
from router import logprobs
from router.edge import Answer, StreamAnswer
from router.failures import (
    HALF_ERRORS,
    DeadlinePassed,
    HalfFailed,
    as_failure,
    halves_to_abort,
    status_failure,
    worker_reason,
)
from router.prefill_half import PrefillHalf
from router.request import PdRequest
from router.upstream import UpstreamResponse
from router.workers import Worker, mark_failed

if TYPE_CHECKING:
    from router.dispatch import Dispatcher

log = logging.getLogger("pdcluster.router")

_PASSED_ON = ("content-type", "content-encoding")  # the decode's headers that reach the client


class Attempt:
    def __init__(self, dispatcher: Dispatcher, request: PdRequest, prefill: Worker, decode: Worker):
        self.d, self.request, self.prefill, self.decode = dispatcher, request, prefill, decode
        self.prefill_half: PrefillHalf | None = None
        self.response: UpstreamResponse | None = None
        self.timers: list[asyncio.TimerHandle] = []
        self.ended = False
        for worker in (prefill, decode):
            worker.in_flight += 1
            worker.breaker.on_attempt()

    async def answer(self) -> Answer | StreamAnswer:
        """Send both halves and return the client's answer: whole, or a stream that ends the attempt when it ends.
        A failure before the answer starts ends the attempt and raises HalfFailed (retryable or not)."""
        request = self.request
        try:
            raw = orjson.dumps(request.body)
            prefill_half = self.prefill_half = PrefillHalf(self.d.client, self.prefill, request.route, raw,
                                                           request.headers, request.checked.prompt_tokens)
            response = self.response = await self._decode_head(raw, prefill_half)
            self._started()
            headers = {k: v for k in _PASSED_ON if (v := response.headers.get(k)) is not None}
            if request.stream:
                self._arm_deadlines(response)  # and the stream's end ends the attempt
                return StreamAnswer(response.status, self._relay(response, prefill_half), headers, self.end)
            payload = await response.read()
            if request.merge_logprobs:
                merged = logprobs.merge(json.loads(payload), logprobs.prefill_answer(await prefill_half.answer()))
                payload = orjson.dumps(merged)
        except HALF_ERRORS as exc:
            failure = as_failure(self.decode, exc)
            self.end(failure)
            raise failure from None
        except BaseException:  # the client left, or total_timeout passed: both halves may still be working
            self.end()
            raise
        self.d.metrics.count_cached(payload)
        self.end(delivered=True)
        return Answer(response.status, payload, headers)

    async def _decode_head(self, raw: bytes, prefill_half: PrefillHalf) -> UpstreamResponse:
        """The decode's response once its status and headers are in; a failed prefill interrupts the wait."""
        d, request, decode = self.d, self.request, self.decode
        try:
            response = await d.client.request("POST", decode.url, request.route, raw, request.headers,
                                              d.config.first_byte_timeout, prefill_half.watch)
        except TimeoutError:  # it may be working on it still: both halves are aborted
            raise HalfFailed(decode, 504, f"decode {decode.worker_id} sent no answer within first_byte_timeout "
                                          f"({d.config.first_byte_timeout}s)", ends_both=True) from None
        if response.status >= 400:
            self.response = response
            try:
                payload = await response.read()
            except HALF_ERRORS:
                payload = b""
            raise status_failure(decode, response.status, payload)
        return response

    def _started(self) -> None:
        """The decode's answer is starting: both workers did their part (a half-open breaker's trial succeeded)."""
        self.prefill.breaker.on_success()
        self.decode.breaker.on_success()

    async def _relay(self, response: UpstreamResponse, prefill_half: PrefillHalf) -> AsyncGenerator[bytes, None]:
        """The decode's SSE stream, chunk by chunk; an error event if either half fails or a deadline passes."""
        request, metrics = self.request, self.d.metrics
        first, last = True, b""
        chunks = response.iter_chunks() if not request.merge_logprobs else _sse_events(response)
        try:
            async for chunk in chunks:
                if first:
                    self.timers[1].cancel()  # the first token's deadline
                    metrics.ttft.labels(request.route).observe(time.monotonic() - request.attempt_started)
                    if request.merge_logprobs:
                        chunk = logprobs.merge_first_event(chunk, logprobs.prefill_answer(
                            await prefill_half.answer()))
                    first = False
                if b"cached_tokens" in chunk:
                    last = chunk
                elif b'"error"' in chunk:  # a worker's error event: its reason in the router's shape, cleaned
                    chunk = _clean_error_events(chunk, self.decode)
                yield chunk
            metrics.count_cached(_last_event(last))
            self.end(delivered=True)
        except HALF_ERRORS as exc:
            failure = as_failure(self.decode, exc)
            self.end(failure)
            log.warning("stream broke", extra={"request_id": request.request_id, "rids": request.rids,
                                               "error": failure.message, "detail": failure.detail})
            metrics.stream_errors.labels(request.route).inc()
            yield f"data: {json.dumps(error_body(failure.status, failure.message))}\n\n".encode()
        finally:
            self.end()  # the client left mid-stream (the relay was cancelled or closed): a no-op after the above

    def _arm_deadlines(self, response: UpstreamResponse) -> None:
        """total_timeout and first_token_timeout end a stream with a DeadlinePassed (the relay's error event)."""
        loop, config, request = asyncio.get_running_loop(), self.d.config, self.request
        self.timers = [
            loop.call_later(max(0.0, request.deadline - time.monotonic()), response.interrupt, DeadlinePassed(
                self.decode, f"request took longer than total_timeout ({config.total_timeout}s)")),
            loop.call_later(config.first_token_timeout, response.interrupt, DeadlinePassed(
                self.decode, f"no token within first_token_timeout ({config.first_token_timeout}s)")),
        ]

    def end(self, failure: HalfFailed | None = None, delivered: bool = False) -> None:
        """Give back everything the attempt holds. `failure`: the half that failed (its breaker hears of it, the other
        half is aborted); neither `failure` nor `delivered`: the router ended it, both halves are aborted."""
        if self.ended:
            return
        self.ended = True
        for timer in self.timers:
            timer.cancel()
        if self.response is not None:
            self.response.close()
        if not delivered:
            self.d.abort(self.request, halves_to_abort(failure, self.prefill, self.decode))
        if failure is not None:
            self._count_failure(failure)
        for worker in (self.prefill, self.decode):
            worker.breaker.on_end()
            worker.in_flight -= 1
        if self.prefill_half is not None:
            self.prefill_half.let_finish(self.d.background)
        if self.timers:  # a stream that started: the request's duration is its relay's (service.py times the rest)
            self.d.metrics.latency.labels(self.request.route).observe(time.monotonic() - self.request.started)

    def _count_failure(self, failure: HalfFailed) -> None:
        worker = failure.worker
        if failure.counts_against_worker:
            worker.breaker.on_failure()
        if failure.transport:  # unreachable or dropped the connection: out of rotation until a probe succeeds
            mark_failed(worker, threshold=1)
            self.d.metrics.ejections.labels(worker.role.value).inc()


def _clean_error_events(chunk: bytes, decode: Worker) -> bytes:
    """The chunk with each whole `data: {"error": ...}` event rewritten as the router's error (failures.worker_reason):
    SGLang's own carries its shape, and may carry a traceback or a path of the worker's files."""
    events = chunk.split(b"\n\n")
    for i, event in enumerate(events):
        if event.startswith(b"data: {") and b'"error"' in event:
            try:
                payload = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                continue
            error = payload.get("error") if isinstance(payload, dict) else None
            if error is None:
                continue
            code = error.get("code") if isinstance(error, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            reason = worker_reason(event[6:]) or "no reason given"
            events[i] = b"data: " + orjson.dumps(error_body(status, f"decode {decode.worker_id}: {reason}"))
    return b"\n\n".join(events)


def _last_event(chunk: bytes) -> bytes:
    """The last SSE event of a chunk that holds several (SGLang's counts are cumulative: only the last one counts)."""
    events = [e for e in chunk.split(b"\n\n") if b"cached_tokens" in e]
    return events[-1] if events else b""


async def _sse_events(response: UpstreamResponse) -> AsyncIterator[bytes]:
    """Whole SSE events (needed only when the first event must be rewritten)."""
    buffer = b""
    async for chunk in response.iter_chunks():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer:
        yield buffer

