"""The PD dispatcher: send one request to a prefill and a decode at once, answer with the decode's response.

The data plane uses aiohttp's client: measured on this router (bench/results/relay_experiment.json), httpx's
connection pool cost 5-15 ms of CPU per relayed request and collapsed under concurrency, aiohttp about 1 ms.

Failure rule: whichever half fails first, the other half is aborted through SGLang's /abort_request right away,
so no KV slot waits out SGLang's own (300 s by default) timeouts. Before the answer is handed to the client, a
failure raises HalfFailed (the caller may retry on a new pair); after, the stream ends with an SSE error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi.responses import Response, StreamingResponse

from pdcluster.http import error_body
from router import logprobs
from router.metrics import RouterMetrics
from router.workers import Worker

log = logging.getLogger("pdcluster.router")


class HalfFailed(Exception):
    """One half of the pair failed before the client got anything. `retryable`: a new pair may succeed."""

    def __init__(self, worker: Worker, status: int, message: str, body: bytes | None = None,
                 retryable: bool = False, transport: bool = False):
        super().__init__(message)
        self.worker, self.status, self.message, self.body, self.retryable = worker, status, message, body, retryable
        self.transport = transport  # the worker could not be reached or dropped the connection

    def response(self) -> Response:
        if self.body is not None and 400 <= self.status < 500:
            # A worker's own 4xx (e.g. prompt longer than the context) is the client's problem: pass it on as is.
            return Response(self.body, status_code=self.status, media_type="application/json")
        return Response(json.dumps(error_body(self.status, self.message)), status_code=self.status,
                        media_type="application/json")


# What a broken, refused or stalled connection raises (aiohttp's timeouts subclass TimeoutError).
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


def _transport_failure(worker: Worker, exc: Exception) -> HalfFailed:
    if isinstance(exc, TimeoutError):
        return HalfFailed(worker, 504, f"{worker.role.value} {worker.url} timed out ({type(exc).__name__})",
                          retryable=isinstance(exc, aiohttp.ConnectionTimeoutError), transport=True)
    return HalfFailed(worker, 502, f"{worker.role.value} {worker.url} failed: {type(exc).__name__}: {exc}".rstrip(": "),
                      retryable=True, transport=True)


def _status_failure(worker: Worker, status: int, payload: bytes) -> HalfFailed:
    retryable = status >= 500 or status == 429
    return HalfFailed(worker, status if status < 500 else 502, f"{worker.role.value} {worker.url} answered {status}",
                      payload, retryable)


@dataclass
class Exchange:
    """One attempt of one client request on one pair."""

    prefill: Worker
    decode: Worker
    route: str
    rids: list[str]
    stream: bool
    headers: dict[str, str]
    merge_logprobs: bool = False
    started: float = field(default_factory=time.monotonic)


class Dispatcher:
    def __init__(self, client: aiohttp.ClientSession, metrics: RouterMetrics, background: set[asyncio.Task],
                 first_byte_timeout: float, on_failure):
        self.client, self.metrics, self._background = client, metrics, background
        self.first_byte_timeout = first_byte_timeout
        self.on_failure = on_failure  # called with every HalfFailed: breaker and health bookkeeping

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, worker: Worker, rids: list[str]) -> None:
        for rid in rids:
            self.metrics.aborts.labels(worker.role.value).inc()
            try:
                async with self.client.post(f"{worker.url}/abort_request", json={"rid": rid},
                                            timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                    await response.read()
                log.info("abort sent", extra={"rid": rid, "role": worker.role.value, "worker": worker.url})
            except TRANSPORT_ERRORS as exc:
                log.warning("abort failed", extra={"rid": rid, "worker": worker.url, "error": repr(exc)})

    async def _prefill_half(self, ex: Exchange, body: bytes) -> bytes:
        worker = ex.prefill
        try:
            async with self.client.post(f"{worker.url}{ex.route}", data=body, headers=ex.headers) as r:
                payload = await r.read()
        except TRANSPORT_ERRORS as exc:
            raise _transport_failure(worker, exc) from None
        if r.status >= 400:
            raise _status_failure(worker, r.status, payload)
        return payload

    async def _open_decode(self, ex: Exchange, body: bytes) -> aiohttp.ClientResponse:
        return await self.client.post(f"{ex.decode.url}{ex.route}", data=body, headers=ex.headers)

    async def _race(self, ex: Exchange, prefill_task: asyncio.Task, work: asyncio.Task, what: str):
        """Await `work` on the decode, unless the prefill fails first; either way the other half is aborted."""
        done, _ = await asyncio.wait({prefill_task, work}, return_when=asyncio.FIRST_COMPLETED,
                                     timeout=self.first_byte_timeout if what == "headers" else None)
        if not done:
            work.cancel()
            self.spawn(self.abort(ex.decode, ex.rids))
            self.spawn(self.abort(ex.prefill, ex.rids))
            raise HalfFailed(ex.decode, 504, f"decode {ex.decode.url} sent no {what} in {self.first_byte_timeout}s")
        if work not in done and prefill_task.exception() is not None:
            work.cancel()
            self.spawn(self.abort(ex.decode, ex.rids))
            raise prefill_task.exception()
        try:
            return await work
        except TRANSPORT_ERRORS as exc:
            self.spawn(self.abort(ex.prefill, ex.rids))
            raise _transport_failure(ex.decode, exc) from None

    async def forward(self, ex: Exchange, body: dict[str, Any]) -> Response:
        raw = json.dumps(body).encode()
        ex.headers = {**ex.headers, "content-type": "application/json"}
        ex.prefill.in_flight += 1
        ex.decode.in_flight += 1
        prefill_task = asyncio.create_task(self._prefill_half(ex, raw))
        handed_over = False
        try:
            response = await self._race(ex, prefill_task, asyncio.create_task(self._open_decode(ex, raw)), "headers")
            if response.status >= 400:
                payload = await response.read()
                response.release()
                self.spawn(self.abort(ex.prefill, ex.rids))
                raise _status_failure(ex.decode, response.status, payload)
            passthrough = {k: response.headers[k] for k in ("content-type", "content-encoding") if k in response.headers}
            if ex.stream:
                handed_over = True
                return StreamingResponse(self._relay(ex, response, prefill_task), status_code=response.status,
                                         headers=passthrough)
            try:
                payload = await self._race(ex, prefill_task, asyncio.create_task(response.read()), "answer")
            finally:
                response.release()
            if ex.merge_logprobs:
                prefill_payload = await asyncio.wait_for(asyncio.shield(prefill_task), 30)
                merged = logprobs.merge(json.loads(payload), logprobs.prefill_answer(prefill_payload))
                payload = json.dumps(merged).encode()
            return Response(payload, status_code=response.status, headers=passthrough)
        except asyncio.CancelledError:
            # The client went away before the answer started: free both halves.
            self.spawn(self.abort(ex.prefill, ex.rids))
            self.spawn(self.abort(ex.decode, ex.rids))
            raise
        finally:
            if not handed_over:
                self._release(ex, prefill_task)

    def _release(self, ex: Exchange, prefill_task: asyncio.Task) -> None:
        ex.prefill.in_flight -= 1
        ex.decode.in_flight -= 1
        # The prefill's own answer may trail the decode's by a moment: let it finish rather than cut it off.
        self.spawn(_reap(prefill_task))

    async def _relay(self, ex: Exchange, response: aiohttp.ClientResponse, prefill_task: asyncio.Task) -> AsyncIterator[bytes]:
        """Pass the decode's SSE stream through chunk by chunk; end it with an error event if either half fails."""
        prefill_failure: list[HalfFailed] = []

        def on_prefill_done(task: asyncio.Task) -> None:
            if not task.cancelled() and isinstance(task.exception(), HalfFailed):
                prefill_failure.append(task.exception())
                self.spawn(self.abort(ex.decode, ex.rids))
                response.close()  # wakes the relay loop below at once

        prefill_task.add_done_callback(on_prefill_done)
        completed, first = False, True
        chunks = response.content.iter_any() if not ex.merge_logprobs else _sse_events(response)
        try:
            try:
                async for chunk in chunks:
                    if first:
                        self.metrics.ttft.labels(ex.route).observe(time.monotonic() - ex.started)
                        if ex.merge_logprobs:
                            prefill = logprobs.prefill_answer(await asyncio.wait_for(asyncio.shield(prefill_task), 30))
                            chunk = logprobs.merge_first_event(chunk, prefill)
                        first = False
                    yield chunk
                completed = not prefill_failure
            except TRANSPORT_ERRORS as exc:
                if not prefill_failure:
                    self.spawn(self.abort(ex.prefill, ex.rids))
                    failure = _transport_failure(ex.decode, exc)
                    self.on_failure(failure)
                    log.warning("stream broke", extra={"rids": ex.rids, "error": failure.message})
                    yield self._error_event(ex, failure)
            if prefill_failure:
                self.on_failure(prefill_failure[0])
                log.warning("stream broke", extra={"rids": ex.rids, "error": prefill_failure[0].message})
                yield self._error_event(ex, prefill_failure[0])
        except (asyncio.CancelledError, GeneratorExit):
            if not completed:  # the client disconnected mid-stream
                self.spawn(self.abort(ex.prefill, ex.rids))
                self.spawn(self.abort(ex.decode, ex.rids))
            raise
        finally:
            prefill_task.remove_done_callback(on_prefill_done)
            response.close()
            self._release(ex, prefill_task)
            self.metrics.latency.labels(ex.route).observe(time.monotonic() - ex.started)

    def _error_event(self, ex: Exchange, failure: HalfFailed) -> bytes:
        self.metrics.stream_errors.labels(ex.route).inc()
        return f"data: {json.dumps(error_body(failure.status, failure.message))}\n\n".encode()


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Whole SSE events (needed only when the first event must be rewritten)."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer:
        yield buffer


async def _reap(task: asyncio.Task, timeout: float = 30.0) -> None:
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except asyncio.TimeoutError:
        task.cancel()
    except (HalfFailed, asyncio.CancelledError):
        pass
