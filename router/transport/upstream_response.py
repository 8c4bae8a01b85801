"""What the data plane's HTTP client (router/transport/upstream.py) hands back: a response whose body is read whole or
as it arrives (and cut into whole SSE events: `sse_events`), and the errors an exchange ends with. It imports nothing of
the router's: the connection that feeds a response is known here only by what the response asks of it (`Feed`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

PAUSE_ABOVE = 1 << 20  # bytes buffered for a consumer iterating behind the worker before its connection pauses


class UpstreamError(Exception):
    """The worker could not be reached, or the exchange broke. Subclasses say how."""


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, or connect_timeout passed): the worker never saw it."""


class ConnectionDropped(UpstreamError):
    """The connection closed or sent garbage before the response was complete."""

    def __init__(self, message: str, before_response: bool = False):
        super().__init__(message)
        self.before_response = before_response  # not one byte of a response: safe to resend on a new connection


class ReadTimeout(UpstreamError, TimeoutError):
    """No byte came for `seconds` (read_timeout, unless the wait had a limit of its own)."""

    def __init__(self, seconds: float):
        super().__init__(f"no data for {seconds}s")
        self.seconds = seconds


class Feed(Protocol):
    """What a response asks of the connection that feeds it (router/transport/upstream.py's `_Connection`)."""

    transport: asyncio.Transport
    paused: bool
    response: UpstreamResponse | None

    def resume(self) -> None: ...


class UpstreamResponse:
    """A response whose status and headers have arrived; its body is read with read() or iterated as it arrives.
    A response that fails (dropped, timed out, interrupted, closed or cancelled before its end) drops its
    connection: only a complete one gives it back to the pool."""

    def __init__(self, conn: Feed, read_timeout: float):
        self._conn, self._read_timeout = conn, read_timeout
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._streaming = False  # iter_chunks() consumes it: the only case in which reading may pause
        self._waiter: asyncio.Future | None = None
        self._error: Exception | None = None
        self.done = False  # the whole body has arrived

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        # Only a consumer that iterates ever takes the buffer before the end: pausing for read(), which waits for
        # the end, would wait forever. Their bodies are bounded by what the worker sends.
        if self._streaming and self._buffered > PAUSE_ABOVE and not self._conn.paused:
            self._conn.paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _end(self, error: Exception | None = None) -> None:
        """Complete (no error) or fail, once."""
        if not self.done and self._error is None:
            self._error, self.done = error, error is None
            self._wake()

    @property
    def error(self) -> Exception | None:
        return self._error

    def interrupt(self, error: Exception) -> None:
        """Make whoever waits on this response (headers or body) raise `error` now, and drop the connection."""
        if not self.done:
            self._end(error)
            self._conn.transport.close()

    async def _wait(self, timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timeout = timeout or self._read_timeout
        timer = loop.call_later(timeout, self._time_out, waiter, timeout)
        try:
            await waiter
        except asyncio.CancelledError:
            self.close()  # whoever waited gave up: the rest of this response would arrive for nobody
            raise
        finally:
            timer.cancel()
            self._waiter = None

    def _time_out(self, waiter: asyncio.Future, seconds: float) -> None:
        if not waiter.done():  # else data came in this very loop iteration: no timeout
            self.interrupt(ReadTimeout(seconds))

    async def wait_headers(self, timeout: float | None = None) -> None:
        while not self.status and self._error is None:
            await self._wait(timeout)
        if not self.status and self._error is not None:  # the loop ends on a status or an error
            raise self._error

    def _take(self) -> list[bytes]:
        chunks, self._chunks = self._chunks, []
        self._buffered = 0
        if self._conn.response is self:  # once complete, the connection may be pausing for someone else
            self._conn.resume()
        return chunks

    async def iter_chunks(self):
        """The body as it arrives: whatever has arrived since the last step, in one piece (under load, fewer and
        larger writes to the client). Raises UpstreamError if the exchange breaks or stalls for read_timeout."""
        self._streaming = True
        while True:
            if self._chunks:
                chunks = self._take()
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
            elif self.done:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    async def read(self) -> bytes:
        while not self.done:
            if self._error is not None:
                raise self._error
            await self._wait()
        return b"".join(self._take())

    def close(self) -> None:
        """Give the connection back if the body is complete; otherwise drop it (the only way to cancel a request)."""
        if not self.done:
            self.interrupt(ConnectionDropped("the response was closed before its end"))


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """Whole SSE events out of a stream's chunks, for a reader that rewrites events (the merged logprobs, the OpenAI
    surface's answers): a chunk may end inside an event."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer:
        yield buffer
