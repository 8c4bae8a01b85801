"""The PD dispatcher: send one request to a prefill and a decode at once, answer with the decode's response.

Both halves go through router/upstream.py, the data plane's own lean HTTP client (why: see that module).

Failure rule: whichever half fails first, the other half is aborted through SGLang's /abort_request right away,
so no KV slot waits out SGLang's own (300 s by default) timeouts. Before the answer is handed to the client, a
failure raises HalfFailed (the caller may retry on a new pair); after, the stream ends with an SSE error event.
"""

from __future__ import annotations

import asyncio
import json  # on the rare paths (logprob merge, error events), as logprobs.py: it accepts NaN/Infinity, orjson not
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdcluster.http import error_body
from router import logprobs
from router.edge import Answer, StreamAnswer
from router.metrics import RouterMetrics
from router.failures import TRANSPORT_ERRORS, DeadlinePassed, HalfFailed, status_failure, transport_failure
from router.upstream import ConnectionDropped, UpstreamClient, UpstreamResponse
from router.workers import Worker

log = logging.getLogger("pdcluster.router")


_JSON = {"content-type": "application/json"}
_PREFILL_GRACE = 30.0  # seconds a prefill's answer may trail the decode's before it is cut off


def _prefill_payload(worker: Worker, status: int, payload: bytes) -> bytes:
    """The prefill's answer, whose only use is logprobs; its status is what says the half failed."""
    if status >= 400:
        raise status_failure(worker, status, payload)
    return payload


class _PrefillWatch:
    """Fails the decode's response the moment the prefill half fails: with no prefill, no KV will ever arrive."""

    def __init__(self) -> None:
        self.response: UpstreamResponse | None = None
        self.failure: HalfFailed | None = None

    def on_sent(self, response: UpstreamResponse) -> None:
        self.response = response
        if self.failure is not None:
            response.interrupt(self.failure)

    def on_prefill_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and isinstance(task.exception(), HalfFailed):
            self.failure = task.exception()
            if self.response is not None:
                self.response.interrupt(self.failure)


@dataclass
class Exchange:
    """One attempt of one client request on one pair."""

    prefill: Worker
    decode: Worker
    route: str
    rids: list[str]
    stream: bool
    headers: dict[str, str]
    request_id: str = ""
    merge_logprobs: bool = False
    deadline: float = float("inf")  # time.monotonic() by which the whole request must be over (total_timeout)
    total_timeout: float = 0.0
    first_token_timeout: float | None = None  # a stream's first event must come within this many seconds
    started: float = field(default_factory=time.monotonic)


class Dispatcher:
    def __init__(self, client: UpstreamClient, metrics: RouterMetrics, background: set[asyncio.Task],
                 first_byte_timeout: float, on_failure):
        self.client, self.metrics, self._background = client, metrics, background
        self.first_byte_timeout = first_byte_timeout
        self.on_failure = on_failure  # called with every HalfFailed: breaker and health bookkeeping

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort(self, ex: Exchange, *workers: Worker) -> None:
        """Free the KV slots of this attempt on `workers` now, in the background (SGLang's /abort_request)."""
        for worker in workers:
            self.spawn(self._abort(worker, ex.rids, ex.request_id))

    async def _abort(self, worker: Worker, rids: list[str], request_id: str) -> None:
        for rid in rids:
            self.metrics.aborts.labels(worker.role.value).inc()
            try:
                async with asyncio.timeout(5.0):
                    response = await self.client.request("POST", worker.url, "/abort_request",
                                                         orjson.dumps({"rid": rid}), _JSON)
                    await response.read()
                log.info("abort sent", extra={"request_id": request_id, "rid": rid, "role": worker.role.value,
                                              "worker": worker.url})
            except TRANSPORT_ERRORS as exc:
                log.warning("abort failed", extra={"request_id": request_id, "rid": rid, "worker": worker.url,
                                                   "error": repr(exc)})

    async def _prefill_half(self, ex: Exchange, body: bytes) -> bytes:
        worker = ex.prefill
        r = None
        try:
            r = await self.client.request("POST", worker.url, ex.route, body, ex.headers)
            payload = await r.read()
        except TRANSPORT_ERRORS as exc:
            raise transport_failure(worker, exc) from None
        finally:
            if r is not None:
                r.close()
        return _prefill_payload(worker, r.status, payload)

    def _start_prefill(self, ex: Exchange, raw: bytes) -> asyncio.Future:
        """The prefill half as a future of its answer. On a kept-alive connection it is followed by callbacks, not
        a task: the prefill's answer is only waited for, never streamed, and a task costs the router ~5% of its CPU."""
        response = self.client.send_now("POST", ex.prefill.url, ex.route, raw, ex.headers)
        if response is None:  # no idle connection: connecting takes a task
            return asyncio.create_task(self._prefill_half(ex, raw))
        outcome = asyncio.get_running_loop().create_future()

        def finished(r: UpstreamResponse) -> None:
            if outcome.done():
                return
            if r.error is None:
                try:
                    outcome.set_result(_prefill_payload(ex.prefill, r.status, r.body()))
                except HalfFailed as failure:
                    outcome.set_exception(failure)
            elif isinstance(r.error, ConnectionDropped) and r.error.before_response:
                # The worker had closed that kept-alive connection: resend on a new one.
                _follow(asyncio.create_task(self._prefill_half(ex, raw)), outcome)
            else:
                outcome.set_exception(transport_failure(ex.prefill, r.error))

        response.on_done = finished
        outcome.add_done_callback(lambda f: response.close() if f.cancelled() else None)
        return outcome

    async def _prefill_answer(self, ex: Exchange, prefill_task: asyncio.Future) -> bytes:
        """The prefill's own answer (for its input logprobs), which may trail the decode's by a moment."""
        try:
            return await asyncio.wait_for(asyncio.shield(prefill_task), _PREFILL_GRACE)
        except TimeoutError:
            raise HalfFailed(ex.prefill, 504, f"prefill {ex.prefill.worker_id} did not answer within "
                                              f"{_PREFILL_GRACE:.0f}s of the decode") from None

    async def forward(self, ex: Exchange, body: dict[str, Any]) -> Answer | StreamAnswer:
        raw = orjson.dumps(body)
        ex.headers["content-type"] = "application/json"
        ex.prefill.in_flight += 1
        ex.decode.in_flight += 1
        prefill_task: asyncio.Future | None = None
        handed_over = False
        try:
            try:
                prefill_task = self._start_prefill(ex, raw)
            except TRANSPORT_ERRORS as exc:  # e.g. a worker URL the data plane cannot speak to
                raise transport_failure(ex.prefill, exc) from None
            watch = _PrefillWatch()
            prefill_task.add_done_callback(watch.on_prefill_done)
            try:
                response = await self.client.request("POST", ex.decode.url, ex.route, raw, ex.headers,
                                                     self.first_byte_timeout, watch.on_sent)
            except HalfFailed:  # the prefill failed first (interrupt): no KV will ever come
                self.abort(ex, ex.decode)
                raise
            except TimeoutError:
                self.abort(ex, ex.decode, ex.prefill)
                raise HalfFailed(ex.decode, 504, f"decode {ex.decode.worker_id} sent no answer within "
                                                 f"first_byte_timeout ({self.first_byte_timeout}s)") from None
            except TRANSPORT_ERRORS as exc:
                self.abort(ex, ex.prefill)
                raise transport_failure(ex.decode, exc) from None
            if response.status >= 400:
                try:
                    payload = await response.read()
                except (*TRANSPORT_ERRORS, HalfFailed):
                    payload = b""
                finally:
                    response.close()
                self.abort(ex, ex.prefill)
                raise status_failure(ex.decode, response.status, payload)
            passthrough = {k: response.headers[k] for k in ("content-type", "content-encoding") if k in response.headers}
            if ex.stream:
                handed_over = True
                return StreamAnswer(response.status, self._relay(ex, response, prefill_task), passthrough)
            try:
                payload = await response.read()
            except HalfFailed:
                self.abort(ex, ex.decode)
                raise
            except TRANSPORT_ERRORS as exc:
                self.abort(ex, ex.prefill)
                raise transport_failure(ex.decode, exc) from None
            finally:
                response.close()
            if ex.merge_logprobs:
                merged = logprobs.merge(json.loads(payload),
                                        logprobs.prefill_answer(await self._prefill_answer(ex, prefill_task)))
                payload = orjson.dumps(merged)
            self.metrics.count_cached(payload)
            return Answer(response.status, payload, passthrough)
        except asyncio.CancelledError:
            # The client went away, or total_timeout passed, before the answer started: free both halves.
            self.abort(ex, ex.prefill, ex.decode)
            raise
        finally:
            if not handed_over:
                self._release(ex, prefill_task)

    def _release(self, ex: Exchange, prefill_task: asyncio.Future | None) -> None:
        ex.prefill.in_flight -= 1
        ex.decode.in_flight -= 1
        if prefill_task is not None and not prefill_task.done():
            # The prefill's own answer may trail the decode's by a moment: let it finish, within reason.
            self._background.add(prefill_task)
            cutoff = asyncio.get_running_loop().call_later(_PREFILL_GRACE, prefill_task.cancel)

            def finished(task: asyncio.Future) -> None:
                cutoff.cancel()
                self._background.discard(task)
            prefill_task.add_done_callback(finished)

    def _deadlines(self, ex: Exchange, response: UpstreamResponse) -> tuple[asyncio.TimerHandle | None, ...]:
        """Timers that end the stream with a DeadlinePassed: total_timeout, and the first event's deadline."""
        loop = asyncio.get_running_loop()
        total = first = None
        if ex.deadline != float("inf"):
            total = loop.call_later(max(0.0, ex.deadline - time.monotonic()), response.interrupt, DeadlinePassed(
                ex.decode, 504, f"request took longer than total_timeout ({ex.total_timeout}s)"))
        if ex.first_token_timeout is not None:
            first = loop.call_later(ex.first_token_timeout, response.interrupt, DeadlinePassed(
                ex.decode, 504, f"no token within first_token_timeout ({ex.first_token_timeout}s)"))
        return total, first

    async def _relay(self, ex: Exchange, response: UpstreamResponse, prefill_task: asyncio.Future) -> AsyncIterator[bytes]:
        """Pass the decode's SSE stream through chunk by chunk; end it with an error event if either half fails or
        a deadline passes."""
        completed, first, last = False, True, b""
        total_timer, first_timer = self._deadlines(ex, response)
        chunks = response.iter_chunks() if not ex.merge_logprobs else _sse_events(response)
        try:
            try:
                async for chunk in chunks:
                    if first:
                        if first_timer is not None:
                            first_timer.cancel()
                        self.metrics.ttft.labels(ex.route).observe(time.monotonic() - ex.started)
                        if ex.merge_logprobs:
                            prefill = logprobs.prefill_answer(await self._prefill_answer(ex, prefill_task))
                            chunk = logprobs.merge_first_event(chunk, prefill)
                        first = False
                    if b"cached_tokens" in chunk:
                        last = chunk
                    yield chunk
                completed = True
                self.metrics.count_cached(_last_event(last))
            except DeadlinePassed as failure:
                self.abort(ex, ex.prefill, ex.decode)
                yield self._stream_failed(ex, failure)
            except HalfFailed as failure:  # the prefill failed mid-stream (interrupt)
                self.abort(ex, ex.decode)
                yield self._stream_failed(ex, failure)
            except TRANSPORT_ERRORS as exc:
                self.abort(ex, ex.prefill)
                yield self._stream_failed(ex, transport_failure(ex.decode, exc))
        except (asyncio.CancelledError, GeneratorExit):
            if not completed:  # the client disconnected mid-stream
                self.abort(ex, ex.prefill, ex.decode)
            raise
        finally:
            for timer in (total_timer, first_timer):
                if timer is not None:
                    timer.cancel()
            response.close()
            self._release(ex, prefill_task)
            self.metrics.latency.labels(ex.route).observe(time.monotonic() - ex.started)

    def _stream_failed(self, ex: Exchange, failure: HalfFailed) -> bytes:
        if not isinstance(failure, DeadlinePassed):
            self.on_failure(failure)
        log.warning("stream broke", extra={"request_id": ex.request_id, "rids": ex.rids, "error": failure.message,
                                           "detail": failure.detail})
        self.metrics.stream_errors.labels(ex.route).inc()
        return f"data: {json.dumps(error_body(failure.status, failure.message))}\n\n".encode()


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


def _follow(task: asyncio.Task, outcome: asyncio.Future) -> None:
    """Settle `outcome` as `task` ends; cancelling `outcome` cancels `task`."""
    def settle(t: asyncio.Task) -> None:
        if outcome.done():
            return
        if t.cancelled():
            outcome.cancel()
        elif t.exception() is not None:
            outcome.set_exception(t.exception())
        else:
            outcome.set_result(t.result())
    task.add_done_callback(settle)
    outcome.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
