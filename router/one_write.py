"""uvicorn's httptools protocol, sending a plain answer's head and body in one write.

uvicorn writes the status line and headers when the app sends `http.response.start`, and the body when it sends
`http.response.body`: two send() system calls and two TCP segments for every JSON answer, where one would do.
Here the head of an answer with a Content-Length waits for its body (or for the answer's end, e.g. HEAD). A
chunked answer (an SSE stream) sends its head at once, so a client sees the status before the first token.

This leans on uvicorn's internals (RequestResponseCycle, _start_asgi_task), so uvicorn is pinned and
tests/unit/test_one_write.py checks the behaviour on the pinned version.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _HeadHeld:
    """The transport as one request's cycle sees it: while `holding`, a write (the head) is kept for the next."""

    __slots__ = ("transport", "head", "holding")

    def __init__(self, transport: asyncio.Transport):
        self.transport, self.head, self.holding = transport, b"", False

    def write(self, data: bytes) -> None:
        if self.holding:
            self.head = data
        elif self.head:
            self.transport.write(self.head + data)
            self.head = b""
        else:
            self.transport.write(data)

    def flush(self) -> None:
        if self.head:
            self.transport.write(self.head)
            self.head = b""

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class _OneWriteCycle(RequestResponseCycle):
    transport: _HeadHeld

    async def send(self, message: Any) -> None:
        held = self.transport
        if self.response_started:  # the body: its write carries the held head along
            await super().send(message)
            if self.response_complete:
                held.flush()  # no body write took the head (a HEAD request's answer)
            return
        held.holding = True  # the head: uvicorn builds and checks it, _HeadHeld keeps it
        try:
            await super().send(message)
        finally:
            held.holding = False
        if self.chunked_encoding:
            held.flush()  # a stream's head goes at once


class OneWriteProtocol(HttpToolsProtocol):
    """Pass as uvicorn's `http=`: every request cycle writes through a _HeadHeld."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.__class__ = _OneWriteCycle  # same fields, one method more: made by uvicorn, sent through ours
        cycle.transport = _HeadHeld(cycle.transport)
        super()._start_asgi_task(cycle, app)
