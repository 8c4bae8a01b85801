"""The router's HTTP edge: the PD routes as bare ASGI, every other route through FastAPI.

Why the PD routes skip the framework: FastAPI/Starlette cost ~0.07 ms of CPU per plain request and ~0.25 ms per
streamed one (bench/README.md, "Router benchmark"), as much as the rest of the router's work on a request. Here a
route is a function from an EdgeRequest to an Answer or a StreamAnswer; uvicorn still parses HTTP.

A client that disconnects is noticed within WATCH_AFTER (uvicorn's receive() returns http.disconnect): the task
serving it is cancelled, which is what makes its attempt (router/pd/attempt.py) abort both halves of the pair. A
stream's answer is closed (StreamAnswer.close) whether or not its first chunk was pulled, so that its pair is always
freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdcluster.common.http import error_parts, read_body
from pdcluster.common.protocol import ErrorType

log = logging.getLogger("pdcluster.router")


@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})


@dataclass
class StreamAnswer:
    status: int
    chunks: AsyncGenerator[bytes, None]  # closed with aclose() (_end_stream)
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream"})
    # Called by the edge once the answer is over, however it ended. Why `chunks` alone is not enough: an async
    # generator that was never started runs no clean-up on aclose(), and a client may leave (or the server's send
    # may fail) before the first chunk is pulled. Must do nothing if the iterator's own clean-up ran.
    close: Callable[[], None] = lambda: None


def error_answer(status: int, message: str, param: str | None = None, kind: ErrorType | None = None) -> Answer:
    return Answer(status, *error_parts(status, message, param, kind))


# Watching for a disconnect costs a task per request (~10% of the router's CPU at 256 clients), and only matters
# for requests that run long enough to be worth aborting: it starts this long after the body was read.
WATCH_AFTER = 0.2


class EdgeRequest:
    """What a PD route sees of a request: lower-cased headers and a size-limited body.

    Once the body is read (and WATCH_AFTER has passed), the request watches for the client's disconnect and calls
    `on_disconnect` if it comes before the answer is finished."""

    def __init__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                 on_disconnect: Callable[[], None] = lambda: None):
        self.headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        self._receive, self._on_disconnect = receive, on_disconnect
        self.finished = False
        self._watch_timer: asyncio.TimerHandle | None = None
        self.watch: asyncio.Future | None = None

    async def stream(self) -> AsyncIterator[bytes]:
        """The body's chunks as they come (what pdcluster.common.http.read_body reads, with its size limit)."""
        more = True
        while more:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone  # left mid-upload: no worker has seen the request, nobody to answer
            yield message.get("body", b"")
            more = message.get("more_body", False)

    async def body(self, limit: int) -> bytes:
        """The whole body; 413 for anything over `limit` bytes. Starts the disconnect watch."""
        raw = await read_body(self, limit)
        self._watch_timer = asyncio.get_running_loop().call_later(WATCH_AFTER, self._start_watch)
        return raw

    def _start_watch(self) -> None:
        # After the body, uvicorn's receive() returns only when the client disconnects or the answer is complete
        # (at once if the client left already).
        self.watch = asyncio.ensure_future(self._receive())
        self.watch.add_done_callback(self._watched)

    def _watched(self, watch: asyncio.Future) -> None:
        if not watch.cancelled() and not self.finished:
            self._on_disconnect()

    def finish(self) -> None:
        self.finished = True
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        if self.watch is not None and not self.watch.done():
            self.watch.cancel()


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


Route = Callable[[EdgeRequest], Awaitable[Answer | StreamAnswer]]


class Edge:
    """The ASGI app uvicorn runs: `routes` (POST path -> Route) served here, the rest (and lifespan) by `app`."""

    def __init__(self, app: Callable, routes: dict[str, Route]):
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
        elif scope["method"] != "POST":
            answer = error_answer(405, f"{scope['path']} takes POST only", None)
            answer.headers["allow"] = "POST"
            await send({"type": "http.response.start", "status": 405, "headers": _headers(answer)})
            await send({"type": "http.response.body", "body": answer.body if scope["method"] != "HEAD" else b""})
        else:
            await self._respond(route, scope, receive, send)

    async def _respond(self, route: Route, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        task, gone = asyncio.current_task(), []
        assert task is not None  # a coroutine's

        def on_disconnect() -> None:
            gone.append(True)
            task.cancel()

        request = EdgeRequest(scope, receive, on_disconnect)
        answer: Answer | StreamAnswer | None = None
        try:
            try:
                answer = await route(request)
            except ClientGone:
                raise
            except Exception:  # a defect of the router's: still a JSON answer, never uvicorn's plain-text 500
                log.exception("unexpected error before the answer", extra={"path": scope["path"]})
                answer = error_answer(500, "the router failed on this request (its log has the details)")
            await send({"type": "http.response.start", "status": answer.status, "headers": _headers(answer)})
            if isinstance(answer, Answer):
                await send({"type": "http.response.body", "body": answer.body})
            else:
                async for chunk in answer.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except ClientGone:
            pass
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # our own cancellation: the client is gone and the halves were aborted; nothing to send
        finally:
            request.finish()
            if isinstance(answer, StreamAnswer):  # on every path, also one where no chunk was ever pulled
                await _end_stream(answer)


async def _end_stream(answer: StreamAnswer) -> None:
    try:
        with contextlib.suppress(Exception):  # cut off between chunks: the relay runs its own clean-up (the aborts)
            await answer.chunks.aclose()
    finally:
        answer.close()


def _headers(answer: Answer | StreamAnswer) -> list[tuple[bytes, bytes]]:
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in answer.headers.items()]
    if isinstance(answer, Answer):
        headers.append((b"content-length", str(len(answer.body)).encode()))
    return headers
