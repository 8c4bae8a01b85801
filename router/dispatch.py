"""The PD dispatcher: send one request to a prefill and a decode at once, answer with the decode's response.

Failure rule: whichever half fails first, the other half is aborted through SGLang's /abort_request right away,
so no KV slot waits out SGLang's own (300 s by default) timeouts, and the client gets a prompt error: a JSON
502/503/504 before the response started, an SSE error event after.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import Response, StreamingResponse

from pdcluster.http import error_body
from router.workers import Worker

log = logging.getLogger("pdcluster.router")

_PASS_HEADERS = ("content-type",)


class HalfFailed(Exception):
    """One half of the pair failed. `status` is what the client gets; `body` is the worker's own error, if any."""

    def __init__(self, worker: Worker, status: int, message: str, body: bytes | None = None):
        super().__init__(message)
        self.worker, self.status, self.message, self.body = worker, status, message, body

    def response(self) -> Response:
        if self.body is not None and 400 <= self.status < 500:
            # A worker's own 4xx (e.g. prompt longer than the context) is the client's problem: pass it on as is.
            return Response(self.body, status_code=self.status, media_type="application/json")
        return Response(json.dumps(error_body(self.status, self.message)), status_code=self.status,
                        media_type="application/json")


def _transport_failure(worker: Worker, exc: Exception) -> HalfFailed:
    if isinstance(exc, httpx.TimeoutException):
        return HalfFailed(worker, 504, f"{worker.role.value} {worker.url} timed out ({type(exc).__name__})")
    return HalfFailed(worker, 502, f"{worker.role.value} {worker.url} failed: {type(exc).__name__}: {exc}".rstrip(": "))


@dataclass
class Pair:
    prefill: Worker
    decode: Worker


class Dispatcher:
    def __init__(self, client: httpx.AsyncClient, on_worker_failure, background: set[asyncio.Task]):
        self.client = client
        self.on_worker_failure = on_worker_failure  # called with a Worker whose transport failed
        self._background = background

    # --- plumbing -------------------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, worker: Worker, rids: list[str]) -> None:
        for rid in rids:
            try:
                await self.client.post(f"{worker.url}/abort_request", json={"rid": rid}, timeout=5.0)
                log.info("aborted rid=%s on %s %s", rid, worker.role.value, worker.url)
            except httpx.HTTPError as exc:
                log.warning("abort of rid=%s on %s failed: %s", rid, worker.url, exc)

    async def _prefill_half(self, worker: Worker, path: str, body: bytes, headers: dict[str, str]) -> None:
        """Send to the prefill and drain its answer; raise HalfFailed if it fails."""
        try:
            async with self.client.stream("POST", f"{worker.url}{path}", content=body, headers=headers) as response:
                payload = await response.aread()
        except httpx.HTTPError as exc:
            self.on_worker_failure(worker)
            raise _transport_failure(worker, exc) from None
        if response.status_code >= 400:
            raise HalfFailed(worker, response.status_code if response.status_code < 500 else 502,
                             f"prefill {worker.url} answered {response.status_code}", payload)

    # --- one request ----------------------------------------------------------------------------------------
    async def forward(self, pair: Pair, path: str, body: dict[str, Any], rids: list[str], stream: bool,
                      headers: dict[str, str]) -> Response:
        raw = json.dumps(body).encode()
        headers = {**headers, "content-type": "application/json"}
        pair.prefill.in_flight += 1
        pair.decode.in_flight += 1
        prefill_task = asyncio.create_task(self._prefill_half(pair.prefill, path, raw, headers))
        request = self.client.build_request("POST", f"{pair.decode.url}{path}", content=raw, headers=headers)
        decode_task = asyncio.create_task(self.client.send(request, stream=True))
        handed_over = False
        try:
            response = await self._decode_headers(pair, prefill_task, decode_task, rids)
            if response.status_code >= 400:
                payload = await response.aread()
                await response.aclose()
                self._spawn(self._abort_and_reap(pair.prefill, rids, prefill_task))
                raise HalfFailed(pair.decode, response.status_code if response.status_code < 500 else 502,
                                 f"decode {pair.decode.url} answered {response.status_code}", payload)
            passthrough = {k: v for k, v in response.headers.items() if k.lower() in _PASS_HEADERS}
            if stream:
                handed_over = True
                return StreamingResponse(self._relay(pair, response, prefill_task, rids),
                                         status_code=response.status_code, headers=passthrough)
            try:
                payload = await self._read_decode(pair, response, prefill_task, rids)
            finally:
                await response.aclose()
            return Response(payload, status_code=response.status_code, headers=passthrough)
        except HalfFailed as failure:
            log.warning("request rids=%s failed: %s", rids, failure.message)
            return failure.response()
        except asyncio.CancelledError:
            # The client went away before the answer started: free both halves.
            self._spawn(self.abort(pair.prefill, rids))
            self._spawn(self.abort(pair.decode, rids))
            raise
        finally:
            if not handed_over:
                self._release(pair, prefill_task, decode_task)

    def _release(self, pair: Pair, prefill_task: asyncio.Task, decode_task: asyncio.Task | None = None) -> None:
        pair.prefill.in_flight -= 1
        pair.decode.in_flight -= 1
        if decode_task is not None and not decode_task.done():
            decode_task.cancel()
        # The prefill's own answer may trail the decode's by a moment: let it finish rather than cut it off.
        self._spawn(self._reap(prefill_task))

    @staticmethod
    async def _reap(task: asyncio.Task, timeout: float = 30.0) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            task.cancel()
        except (HalfFailed, asyncio.CancelledError):
            pass

    async def _abort_and_reap(self, worker: Worker, rids: list[str], task: asyncio.Task) -> None:
        await self.abort(worker, rids)
        await self._reap(task, timeout=10.0)

    async def _decode_headers(self, pair: Pair, prefill_task: asyncio.Task, decode_task: asyncio.Task,
                              rids: list[str]) -> httpx.Response:
        """Wait for the decode's response headers, unless the prefill fails first."""
        done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task in done and prefill_task.exception() is not None and decode_task not in done:
            decode_task.cancel()
            self._spawn(self.abort(pair.decode, rids))
            raise prefill_task.exception()
        try:
            return await decode_task
        except httpx.HTTPError as exc:
            self.on_worker_failure(pair.decode)
            self._spawn(self._abort_and_reap(pair.prefill, rids, prefill_task))
            raise _transport_failure(pair.decode, exc) from None

    async def _read_decode(self, pair: Pair, response: httpx.Response, prefill_task: asyncio.Task,
                           rids: list[str]) -> bytes:
        read_task = asyncio.create_task(response.aread())
        done, _ = await asyncio.wait({prefill_task, read_task}, return_when=asyncio.FIRST_COMPLETED)
        if read_task not in done and prefill_task.exception() is not None:
            read_task.cancel()
            self._spawn(self.abort(pair.decode, rids))
            raise prefill_task.exception()
        try:
            return await read_task
        except httpx.HTTPError as exc:
            self.on_worker_failure(pair.decode)
            self._spawn(self._abort_and_reap(pair.prefill, rids, prefill_task))
            raise _transport_failure(pair.decode, exc) from None

    async def _relay(self, pair: Pair, response: httpx.Response, prefill_task: asyncio.Task,
                     rids: list[str]) -> AsyncIterator[bytes]:
        """Pass the decode's SSE stream through chunk by chunk; end it with an error event if either half fails."""
        prefill_failure: list[HalfFailed] = []

        def on_prefill_done(task: asyncio.Task) -> None:
            if not task.cancelled() and isinstance(task.exception(), HalfFailed):
                prefill_failure.append(task.exception())
                # Closing the decode stream wakes the relay loop below at once.
                self._spawn(self.abort(pair.decode, rids))
                self._spawn(response.aclose())

        prefill_task.add_done_callback(on_prefill_done)
        completed = False
        try:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
                completed = not prefill_failure
            except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: stream closed under us by the callback
                if not prefill_failure:
                    self.on_worker_failure(pair.decode)
                    self._spawn(self._abort_and_reap(pair.prefill, rids, prefill_task))
                    failure = _transport_failure(pair.decode, exc)
                    log.warning("stream rids=%s broke: %s", rids, failure.message)
                    yield _sse_error(failure)
            if prefill_failure:
                log.warning("stream rids=%s: %s", rids, prefill_failure[0].message)
                yield _sse_error(prefill_failure[0])
        except (asyncio.CancelledError, GeneratorExit):
            if not completed:  # the client disconnected mid-stream
                self._spawn(self.abort(pair.prefill, rids))
                self._spawn(self.abort(pair.decode, rids))
            raise
        finally:
            prefill_task.remove_done_callback(on_prefill_done)
            self._spawn(response.aclose())
            self._release(pair, prefill_task)


def _sse_error(failure: HalfFailed) -> bytes:
    return f"data: {json.dumps(error_body(failure.status, failure.message))}\n\n".encode()
