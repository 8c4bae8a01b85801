"""One attempt of a request on one PD pair (pairing's `Choice`), from sending its halves to its end, and the single
owner of all it holds (as nano-vllm's `Sequence` is one scheduler's); with what every attempt shares (`Dispatcher`).
Both halves get the same body at once (router/transport/upstream.py; the prefill's: router/pd/prefill_half.py); the
client gets the decode's answer, relayed chunk by chunk if it is a stream. Its life is its `state`: SENT, ANSWERING,
then one of five endings. It holds the pair's books (in flight on both workers, each breaker's trial), the prefill
half, the decode's response and a stream's two deadline timers. `end()` gives all of it back, once, and records its
`outcome` (ending, failure, the halves aborted: failures.halves_to_abort); a second `end()` does nothing, so any path
that may end one calls it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from enum import Enum

import orjson

from pdcluster.common.http import error_body
from router.config import RouterConfig
from router.fleet.workers import Worker, mark_failed
from router.metrics import RouterMetrics
from router.pd import failures, logprobs
from router.pd.echo import EchoStream, merge_whole
from router.pd.failures import HALF_ERRORS, TRANSPORT_ERRORS, DeadlinePassed, HalfFailed
from router.pd.fan_out_options import FanOutOptions
from router.pd.prefill_half import PrefillHalf
from router.pd.request import PdRequest
from router.routing.policy import Choice
from router.transport.edge import Answer, StreamAnswer
from router.transport.upstream import UpstreamClient, UpstreamResponse
from router.transport.upstream_response import sse_events

log = logging.getLogger("pdcluster.router")

_PASSED_ON = ("content-type", "content-encoding")  # the decode's headers that reach the client
_JSON = {"content-type": "application/json"}
_ABORT_TIMEOUT = 5.0  # seconds an /abort_request may take


class AttemptState(Enum):
    SENT = "sent"  # both halves sent; the decode's answer has not started
    ANSWERING = "answering"  # the decode's answer started: both workers did their part
    DELIVERED = "delivered"  # a plain answer read whole, or a stream relayed to its last chunk
    CLIENT_GONE = "client gone"  # the client left (or the edge closed a stream whose relay never began)
    FAILED_BEFORE_FIRST_BYTE = "failed before the first byte"  # a half failed: the caller may retry on a new pair
    FAILED_AFTER_FIRST_BYTE = "failed after the first byte"  # a half failed mid-stream: the client gets an error event
    DEADLINE = "deadline"  # total_timeout passed, or a stream's first_token_timeout

    @property
    def ended(self) -> bool:
        return self not in (AttemptState.SENT, AttemptState.ANSWERING)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: its ending, the failure (a half's, or the deadline's) and the halves it aborted."""

    ending: AttemptState
    failure: HalfFailed | None = None
    aborted: tuple[Worker, ...] = ()


@dataclass
class Dispatcher:
    """What every attempt shares: the data plane's client, the metrics, the background tasks, the config."""

    client: UpstreamClient
    metrics: RouterMetrics
    background: set[asyncio.Future]
    config: RouterConfig

    def abort(self, request: PdRequest, workers: Iterable[Worker]) -> None:
        """Free the KV slots of the current attempt on `workers` now, in the background (SGLang's /abort_request)."""
        for worker in workers:
            task = asyncio.create_task(self._abort(worker, request.rids, request.request_id))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def _abort(self, worker: Worker, rids: list[str], request_id: str) -> None:
        for rid in rids:
            self.metrics.aborts.labels(worker.role.value).inc()
            try:
                async with asyncio.timeout(_ABORT_TIMEOUT):
                    response = await self.client.request("POST", worker.url, "/abort_request",
                                                         orjson.dumps({"rid": rid}), _JSON)
                    await response.read()
                log.info("abort sent", extra={"request_id": request_id, "rid": rid, "worker": worker.url})
            except TRANSPORT_ERRORS as exc:
                log.warning("abort failed", extra={"request_id": request_id, "rid": rid, "worker": worker.url,
                                                   "error": repr(exc)})


class Attempt:
    def __init__(self, dispatcher: Dispatcher, request: PdRequest, choice: Choice, fanned: FanOutOptions | None = None):
        self.d, self.request, self.choice, self.fanned = dispatcher, request, choice, fanned
        self.prefill, self.decode = choice.prefill, choice.decode
        # TTFT and a stream's duration are observed here, unless it is a fan-out's choice (router/openai/fanout.py
        # times the merged answer).
        self.timed = fanned is None
        self.state = AttemptState.SENT
        self.outcome: Outcome | None = None  # set by end()
        self.prefill_half: PrefillHalf | None = None
        self.response: UpstreamResponse | None = None
        self.total_timer: asyncio.TimerHandle | None = None  # a stream's total_timeout
        self.first_token_timer: asyncio.TimerHandle | None = None  # a stream's first_token_timeout
        for worker in (self.prefill, self.decode):
            worker.in_flight += 1
            worker.breaker.on_attempt()

    async def answer(self) -> Answer | StreamAnswer:
        """Both halves sent, the client's answer (a stream ends the attempt at its end); HalfFailed before it starts."""
        request = self.request
        try:
            raw = orjson.dumps(request.body)
            prefill_half = self.prefill_half = PrefillHalf(self.d.client, request, self.choice, raw, self.fanned)
            response = self.response = await self._decode_head(raw, prefill_half)
            self.state = AttemptState.ANSWERING  # both workers did their part (a half-open breaker's trial succeeded)
            self.prefill.breaker.on_success()
            self.decode.breaker.on_success()
            headers = {k: v for k in _PASSED_ON if (v := response.headers.get(k)) is not None}
            if request.stream:
                self._arm_deadlines(response)  # and the stream's end ends the attempt
                return StreamAnswer(response.status, self._relay(response, prefill_half), headers, self.end)
            payload = await response.read()
            if request.merge_logprobs:
                payload = _merged(request, payload, await prefill_half.answer())
        except HALF_ERRORS as exc:
            failure = failures.as_failure(self.decode, exc)
            self.end(AttemptState.FAILED_BEFORE_FIRST_BYTE, failure)
            raise failure from None
        except BaseException:  # cancelled: the client left, or total_timeout passed; both halves may still work on it
            self.end(AttemptState.DEADLINE if time.monotonic() >= request.deadline else AttemptState.CLIENT_GONE)
            raise
        self.d.metrics.count_cached(payload, predicted=self.choice.predicted_cached)
        self.end(AttemptState.DELIVERED)
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
            raise failures.status_failure(decode, response.status, payload)
        return response

    async def _relay(self, response: UpstreamResponse, prefill_half: PrefillHalf) -> AsyncGenerator[bytes, None]:
        """The decode's SSE stream, chunk by chunk; an error event if either half fails or a deadline passes."""
        request, metrics = self.request, self.d.metrics
        first_at, events, last = 0.0, 0, b""
        chunks, asked, echoed = response.iter_chunks(), request.checked.prompt_logprobs, None
        try:
            async for chunk in chunks if not request.merge_logprobs else sse_events(chunks):
                if not first_at:
                    first_at = time.monotonic()
                    if self.first_token_timer is not None:
                        self.first_token_timer.cancel()
                    if self.timed:
                        metrics.first_token(request.route, first_at - request.attempt_started)
                    if asked is not None:  # a completion's echoed prompt: each choice's first event
                        echoed = EchoStream(await prefill_half.answer(), asked)
                    elif request.merge_logprobs:
                        chunk = logprobs.merge_first_event(chunk, logprobs.prefill_answer(await prefill_half.answer()))
                if echoed is not None:
                    chunk = echoed.event(chunk)
                events += chunk.count(b"\n\n")  # an event's end: JSON strings escape their newlines
                if b"cached_tokens" in chunk:
                    last = chunk
                elif b'"error"' in chunk:  # a worker's error event: its reason in the router's shape, cleaned
                    chunk = failures.clean_error_events(chunk, self.decode)
                yield chunk
                if chunk.endswith(b"data: [DONE]\n\n"):  # the last event: whole, even if the client goes now
                    break
            metrics.count_cached(last, stream=True, predicted=self.choice.predicted_cached)
            metrics.stream_ended(request.route if self.timed else None, first_at, events)
            self.end(AttemptState.DELIVERED)
        except HALF_ERRORS as exc:
            failure = failures.as_failure(self.decode, exc)
            deadline = isinstance(failure, DeadlinePassed)
            self.end(AttemptState.DEADLINE if deadline else AttemptState.FAILED_AFTER_FIRST_BYTE, failure)
            log.warning("stream broke", extra={"request_id": request.request_id, "rids": request.rids,
                                               "error": failure.message, "detail": failure.detail})
            metrics.stream_errors.labels(request.route).inc()
            yield b"data: " + orjson.dumps(error_body(failure.status, failure.message)) + b"\n\n"
        finally:
            self.end(AttemptState.CLIENT_GONE)  # the relay was cancelled or closed: a no-op after the above

    def _arm_deadlines(self, response: UpstreamResponse) -> None:
        """total_timeout and first_token_timeout end a stream with a DeadlinePassed (made only if one passes)."""
        loop, config, request = asyncio.get_running_loop(), self.d.config, self.request
        self.total_timer = loop.call_later(max(0.0, request.deadline - time.monotonic()), lambda: response.interrupt(
            DeadlinePassed(self.decode, f"request took longer than total_timeout ({config.total_timeout}s)")))
        self.first_token_timer = loop.call_later(config.first_token_timeout, lambda: response.interrupt(
            DeadlinePassed(self.decode, f"no token within first_token_timeout ({config.first_token_timeout}s)")))

    def _queue_explains(self, failure: HalfFailed) -> bool:
        """A decode that waited out SGLang's KV timeout while the prefill half had not answered: the prefill's queue
        (or, if it hangs, liveness's business) explains the wait, not the decode, whose breaker does not hear of it."""
        explained = failures.kv_wait_timed_out(failure) and self.prefill_half is not None and \
            not self.prefill_half.future.done()
        if explained:
            log.warning("decode waited out its KV while the prefill had not answered: not held against the decode",
                        extra={"request_id": self.request.request_id, "decode": self.decode.worker_id,
                               "prefill": self.prefill.worker_id})
        return explained

    def end(self, ending: AttemptState = AttemptState.CLIENT_GONE, failure: HalfFailed | None = None) -> None:
        """Give back everything the attempt holds, and record its `outcome`. `failure`: the half that failed (its
        breaker hears of it, the other half is aborted); none, and not delivered: both halves are aborted."""
        if self.state.ended:
            return
        streamed = self.request.stream and self.state is AttemptState.ANSWERING
        self.state = ending
        for timer in (self.total_timer, self.first_token_timer):
            if timer is not None:
                timer.cancel()
        if self.response is not None:
            self.response.close()
        delivered = ending is AttemptState.DELIVERED
        aborted = () if delivered else failures.halves_to_abort(failure, self.prefill, self.decode)
        self.d.abort(self.request, aborted)  # no KV slot waits out SGLang's own timeouts
        if failure is not None and failure.counts_against_worker and not self._queue_explains(failure):
            failure.worker.breaker.on_failure()
        if failure is not None and failure.transport:  # unreachable, or dropped the connection: out of rotation
            mark_failed(failure.worker, threshold=1)  # until a probe succeeds
            self.d.metrics.ejections.labels(failure.worker.role.value).inc()
        for worker in (self.prefill, self.decode):
            worker.breaker.on_end()
            worker.in_flight -= 1
        if self.prefill_half is not None:
            self.prefill_half.let_finish(self.d.background, delivered)
        if streamed and self.timed:  # the request's duration is its relay's (service.py times the rest)
            self.d.metrics.latency.labels(self.request.route).observe(time.monotonic() - self.request.started)
        self.outcome = Outcome(ending, failure, aborted)


def _merged(request: PdRequest, decode: bytes, prefill: bytes) -> bytes:
    """A whole answer with the prefill's input logprobs merged in: a completion's echoed prompt, or /generate's."""
    asked = request.checked.prompt_logprobs
    return merge_whole(decode, prefill, asked) if asked is not None else logprobs.merge_answer(decode, prefill)
