"""The PD dispatcher: one attempt of a request on one pair. The same body goes to the prefill and the decode at
once; the client gets the decode's answer, relayed chunk by chunk if it is a stream.

Both halves go through router/upstream.py, the data plane's own lean HTTP client (why: see that module).

Failure rule: whichever half fails first, the other half is aborted through SGLang's /abort_request right away
(which halves: failures.halves_to_abort), so no KV slot waits out SGLang's own (300 s by default) timeouts. Before
the answer is handed to the client, a failure raises HalfFailed (the caller may retry on a new pair); after, the
stream ends with an SSE error event. The workers' books (in flight, breaker, ejection) are the attempt's Lease's.
"""

from __future__ import annotations

import asyncio
import json  # on the rare paths (logprob merge, error events), as logprobs.py: it accepts NaN/Infinity, orjson not
import logging
import time
from collections.abc import AsyncIterator, Iterable

import orjson

from pdcluster.http import error_body
from router import logprobs
from router.config import RouterConfig
from router.edge import Answer, StreamAnswer
from router.failures import (HALF_ERRORS, TRANSPORT_ERRORS, DeadlinePassed, HalfFailed, as_failure, halves_to_abort,
                             status_failure, transport_failure)
from router.lease import Lease
from router.metrics import RouterMetrics
from router.prefill_half import PrefillHalf
from router.request import PdRequest
from router.upstream import UpstreamClient, UpstreamResponse
from router.workers import Worker

log = logging.getLogger("pdcluster.router")

_JSON = {"content-type": "application/json"}
_ABORT_TIMEOUT = 5.0  # seconds an /abort_request may take
_PASSED_ON = ("content-type", "content-encoding")  # the decode's headers that reach the client


class Dispatcher:
    def __init__(self, client: UpstreamClient, metrics: RouterMetrics, background: set[asyncio.Future],
                 config: RouterConfig):
        self.client, self.metrics, self._background = client, metrics, background
        self.first_byte_timeout = config.first_byte_timeout
        self.first_token_timeout = config.first_token_timeout
        self.total_timeout = config.total_timeout

    async def forward(self, request: PdRequest, prefill: Worker, decode: Worker) -> Answer | StreamAnswer:
        """The current attempt of `request` on this pair. Raises HalfFailed if it fails before the answer starts."""
        with Lease(prefill, decode, self.metrics.ejections) as lease:
            raw = orjson.dumps(request.body)
            try:
                prefill_half = PrefillHalf(self.client, prefill, request.route, raw, request.headers,
                                           request.checked.prompt_tokens)
            except TRANSPORT_ERRORS as exc:  # e.g. a worker URL the data plane cannot speak to: nothing was sent
                raise transport_failure(prefill, exc) from None
            try:
                return await self._decode_half(request, lease, raw, prefill_half)
            except asyncio.CancelledError:
                # The client went away, or total_timeout passed, before the answer started: free both halves.
                self.abort(request, halves_to_abort(None, prefill, decode))
                raise
            finally:
                if not lease.handed_over:
                    prefill_half.let_finish(self._background)

    async def _decode_half(self, request: PdRequest, lease: Lease, raw: bytes,
                           prefill_half: PrefillHalf) -> Answer | StreamAnswer:
        prefill, decode = lease.prefill, lease.decode
        try:
            response = await self._decode_head(request, decode, raw, prefill_half)
            passthrough = {k: v for k in _PASSED_ON if (v := response.headers.get(k)) is not None}
            if request.stream:
                lease.hand_over()
                return StreamAnswer(response.status, self._relay(request, lease, response, prefill_half), passthrough,
                                    lambda: self._close_stream(request, lease, response, prefill_half))
            try:
                payload = await response.read()
            finally:
                response.close()
        except HALF_ERRORS as exc:
            failure = as_failure(decode, exc)
            self.abort(request, halves_to_abort(failure, prefill, decode))
            raise failure from None
        if request.merge_logprobs:
            merged = logprobs.merge(json.loads(payload), logprobs.prefill_answer(await prefill_half.answer()))
            payload = orjson.dumps(merged)
        self.metrics.count_cached(payload)
        return Answer(response.status, payload, passthrough)

    async def _decode_head(self, request: PdRequest, decode: Worker, raw: bytes,
                           prefill_half: PrefillHalf) -> UpstreamResponse:
        """The decode's response once its status and headers are in; a failed prefill interrupts the wait."""
        try:
            response = await self.client.request("POST", decode.url, request.route, raw, request.headers,
                                                 self.first_byte_timeout, prefill_half.watch)
        except TimeoutError:  # it may be working on it still: both halves are aborted
            raise HalfFailed(decode, 504, f"decode {decode.worker_id} sent no answer within first_byte_timeout "
                                          f"({self.first_byte_timeout}s)", ends_both=True) from None
        if response.status >= 400:
            try:
                payload = await response.read()
            except HALF_ERRORS:
                payload = b""
            finally:
                response.close()
            raise status_failure(decode, response.status, payload)
        return response

    async def _relay(self, request: PdRequest, lease: Lease, response: UpstreamResponse,
                     prefill_half: PrefillHalf) -> AsyncIterator[bytes]:
        """Pass the decode's SSE stream through chunk by chunk; end it with an error event if either half fails or
        a deadline passes. Holds the attempt's lease until the stream ends."""
        completed, first, last = False, True, b""
        total_timer, first_timer = self._deadlines(request, lease.decode, response)
        chunks = response.iter_chunks() if not request.merge_logprobs else _sse_events(response)
        try:
            try:
                async for chunk in chunks:
                    if first:
                        first_timer.cancel()
                        self.metrics.ttft.labels(request.route).observe(time.monotonic() - request.attempt_started)
                        if request.merge_logprobs:
                            chunk = logprobs.merge_first_event(chunk,
                                                               logprobs.prefill_answer(await prefill_half.answer()))
                        first = False
                    if b"cached_tokens" in chunk:
                        last = chunk
                    yield chunk
                completed = True
                self.metrics.count_cached(_last_event(last))
            except HALF_ERRORS as exc:
                yield self._stream_failed(request, lease, as_failure(lease.decode, exc))
        except (asyncio.CancelledError, GeneratorExit):
            if not completed:  # the client disconnected mid-stream
                self.abort(request, halves_to_abort(None, lease.prefill, lease.decode))
            raise
        finally:
            total_timer.cancel()
            first_timer.cancel()
            self._end_stream(request, lease, response, prefill_half)

    def _close_stream(self, request: PdRequest, lease: Lease, response: UpstreamResponse,
                      prefill_half: PrefillHalf) -> None:
        """The edge closes every stream it was handed. If its relay never ran (the client left, or the server's
        send failed, before the first chunk was pulled), the attempt still holds its lease: end it as a client
        that leaves mid-stream does, both halves aborted. Else the relay ended it already: nothing to do."""
        if lease.held:
            self.abort(request, halves_to_abort(None, lease.prefill, lease.decode))
            self._end_stream(request, lease, response, prefill_half)

    def _end_stream(self, request: PdRequest, lease: Lease, response: UpstreamResponse,
                    prefill_half: PrefillHalf) -> None:
        response.close()
        lease.release()
        prefill_half.let_finish(self._background)
        self.metrics.latency.labels(request.route).observe(time.monotonic() - request.attempt_started)

    def _deadlines(self, request: PdRequest, decode: Worker,
                   response: UpstreamResponse) -> tuple[asyncio.TimerHandle, asyncio.TimerHandle]:
        """Timers that end the stream with a DeadlinePassed: total_timeout, and the first event's deadline."""
        loop = asyncio.get_running_loop()
        total = loop.call_later(max(0.0, request.deadline - time.monotonic()), response.interrupt, DeadlinePassed(
            decode, f"request took longer than total_timeout ({self.total_timeout}s)"))
        first = loop.call_later(self.first_token_timeout, response.interrupt, DeadlinePassed(
            decode, f"no token within first_token_timeout ({self.first_token_timeout}s)"))
        return total, first

    def _stream_failed(self, request: PdRequest, lease: Lease, failure: HalfFailed) -> bytes:
        self.abort(request, halves_to_abort(failure, lease.prefill, lease.decode))
        lease.failed(failure)
        log.warning("stream broke", extra={"request_id": request.request_id, "rids": request.rids,
                                           "error": failure.message, "detail": failure.detail})
        self.metrics.stream_errors.labels(request.route).inc()
        return f"data: {json.dumps(error_body(failure.status, failure.message))}\n\n".encode()

    def abort(self, request: PdRequest, workers: Iterable[Worker]) -> None:
        """Free the KV slots of the current attempt on `workers` now, in the background (SGLang's /abort_request)."""
        for worker in workers:
            task = asyncio.create_task(self._abort(worker, request.rids, request.request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _abort(self, worker: Worker, rids: list[str], request_id: str) -> None:
        for rid in rids:
            self.metrics.aborts.labels(worker.role.value).inc()
            try:
                async with asyncio.timeout(_ABORT_TIMEOUT):
                    response = await self.client.request("POST", worker.url, "/abort_request",
                                                         orjson.dumps({"rid": rid}), _JSON)
                    await response.read()
                log.info("abort sent", extra={"request_id": request_id, "rid": rid, "role": worker.role.value,
                                              "worker": worker.url})
            except TRANSPORT_ERRORS as exc:
                log.warning("abort failed", extra={"request_id": request_id, "rid": rid, "worker": worker.url,
                                                   "error": repr(exc)})


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
