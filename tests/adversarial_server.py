"""An HTTP/1.1 server on loopback that answers at the byte level exactly as scripted, for adversarial client tests.

Each request (on any connection, in order of arrival) gets the next scripted answer: a list of steps, each one of
  bytes          written and drained
  float          seconds to sleep
  CLOSE          close the connection cleanly (FIN) after what was written
  RESET          abort it with a TCP reset (SO_LINGER 0)
  HANG           send nothing more; wait until the client closes
  IdleClose(s)   after this answer, close the connection if no next request comes within s seconds
Once the script runs out (and for a None in it), a request gets `follow_up(n)`: a small 200 JSON answer naming
the request's number n (from 0), so that an answer can never be taken for another's.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass

CLOSE, RESET, HANG = "close", "reset", "hang"


@dataclass(frozen=True)
class IdleClose:
    seconds: float


def pattern(size: int) -> bytes:
    """`size` bytes in which a lost, doubled or moved piece shows (not all equal)."""
    block = bytes(range(256)) + b"0123456789abcdef"  # 272: not a power of two, so offsets don't line up
    return (block * (size // len(block) + 1))[:size]


def head(status: int = 200, reason: bytes = b"OK", **headers: str | int) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    lines += [b"%s: %s\r\n" % (name.replace("_", "-").encode(), str(value).encode()) for name, value in headers.items()]
    return b"".join(lines) + b"\r\n"


def with_length(body: bytes, **headers) -> bytes:
    return head(content_type="application/octet-stream", content_length=len(body), **headers) + body


def chunked(body: bytes, chunk: int, **headers) -> bytes:
    framed = [b"%x\r\n%s\r\n" % (len(body[i:i + chunk]), body[i:i + chunk]) for i in range(0, len(body), chunk)]
    return head(content_type="text/event-stream", transfer_encoding="chunked", **headers) + b"".join(framed) + (
        b"0\r\n\r\n")


def close_delimited(body: bytes) -> bytes:
    return head(content_type="application/octet-stream") + body  # then CLOSE: HTTP/1.0 style


def follow_up_body(n: int) -> bytes:
    return b'{"follow_up": %d}' % n


def follow_up(n: int) -> bytes:
    return head(content_type="application/json", content_length=len(follow_up_body(n))) + follow_up_body(n)


class RawServer:
    def __init__(self, *answers: list):
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self._open: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for writer in self._open.values():  # (not cancelling the tasks: asyncio's streams log that as an error)
            writer.transport.abort()
        if self._open:
            await asyncio.wait(list(self._open), timeout=5)

    async def _read_request(self, reader: asyncio.StreamReader, idle: float | None) -> bytes | None:
        try:
            request_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in request_head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return request_head + await reader.readexactly(length)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[asyncio.current_task()] = writer
        self.connections += 1
        idle = None
        try:
            while (request := await self._read_request(reader, idle)) is not None:
                n = len(self.requests)
                self.requests.append(request)
                idle = None
                answer = self.answers.pop(0) if self.answers else None
                for step in [follow_up(n)] if answer is None else answer:
                    if isinstance(step, bytes):
                        writer.write(step)
                        await writer.drain()
                    elif isinstance(step, float):
                        await asyncio.sleep(step)
                    elif isinstance(step, IdleClose):
                        idle = step.seconds
                    elif step == HANG:
                        await reader.read()  # until the client gives up and closes
                        return
                    elif step == CLOSE:
                        return
                    elif step == RESET:
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        return
                    else:
                        raise ValueError(step)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self._open.pop(asyncio.current_task(), None)
