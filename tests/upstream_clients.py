"""Two HTTP clients behind one small adapter, for tests/unit/test_upstream_adversarial.py: ours
(router/transport/upstream.py) and aiohttp's ClientSession, each run through `case`: one request answered by a scripted
misbehaving worker (tests/adversarial_server.py), then a normal request on the same client, which must come right.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import uvloop

from router.transport.upstream import UpstreamClient, UpstreamError
from router.transport.upstream_response import PAUSE_ABOVE
from tests.adversarial_server import RawServer, follow_up_body

KiB, MiB = 1 << 10, 1 << 20
READ_TIMEOUT = 3.0  # for every case but the stalls: only a stall may ever reach it
STALL_TIMEOUT = 2.0
# The most an iterating consumer that is behind may find buffered: the threshold, plus what the reads in flight
# by the read that crossed it (asyncio and uvloop read at most 256 KiB at a time), with a little room to spare.
BUFFER_BOUND = PAUSE_ABOVE + 512 * KiB


@dataclass
class Got:
    status: int
    headers: dict[str, str]
    body: bytes
    pieces: list[int] = field(default_factory=list)  # the sizes an iterating consumer got, step by step


class Ours:
    errors = (UpstreamError,)

    def __init__(self, read_timeout: float):
        self.client = UpstreamClient(connect_timeout=5, read_timeout=read_timeout)

    async def fetch(self, url: str, method: str, mode: str, first_pause: float, step_pause: float) -> Got:
        r = await self.client.request(method, url, "/generate", b'{"x": 1}' if method == "POST" else b"",
                                      {"content-type": "application/json"})
        try:
            if mode == "read":
                return Got(r.status, dict(r.headers), await r.read())
            pieces = []
            async for piece in r.iter_chunks():
                pieces.append(piece)
                await asyncio.sleep(first_pause if len(pieces) == 1 else step_pause)
            return Got(r.status, dict(r.headers), b"".join(pieces), [len(p) for p in pieces])
        finally:
            r.close()

    async def close(self) -> None:
        await self.client.close()


class Aio:
    errors = (aiohttp.ClientError,)

    def __init__(self, read_timeout: float):
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=read_timeout),
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def fetch(self, url: str, method: str, mode: str, first_pause: float, step_pause: float) -> Got:
        async with self.session.request(method, url + "/generate", data=b'{"x": 1}' if method == "POST" else None,
                                        headers={"content-type": "application/json"}) as r:
            headers = {k.lower(): v for k, v in r.headers.items()}
            if mode == "read":
                return Got(r.status, headers, await r.read())
            pieces = []
            async for piece in r.content.iter_any():
                pieces.append(piece)
                await asyncio.sleep(first_pause if len(pieces) == 1 else step_pause)
            return Got(r.status, headers, b"".join(pieces), [len(p) for p in pieces])

    async def close(self) -> None:
        await self.session.close()


@dataclass
class Outcome:
    result: Got | Exception
    seconds: float
    kind: str
    server: RawServer

    @property
    def ours(self) -> bool:
        return self.kind.startswith("ours")

    def answered(self, body: bytes, status: int = 200) -> Got:
        if isinstance(self.result, Exception):
            raise AssertionError(f"failed instead of answering: {self.result!r}") from self.result
        assert self.result.status == status
        assert len(self.result.body) == len(body) and self.result.body == body
        return self.result

    def broken(self) -> None:
        """An error that says the exchange broke (never a body reported complete), and at once, not by timeout."""
        errors = (UpstreamError,) if self.ours else (aiohttp.ClientError,)
        assert isinstance(self.result, errors), f"expected an error, got {self.result!r}"
        assert not isinstance(self.result, TimeoutError), f"waited out the timeout: {self.result!r}"

    def timed_out(self, timeout: float) -> None:
        errors = (UpstreamError,) if self.ours else (aiohttp.ClientError,)
        assert isinstance(self.result, errors) and isinstance(self.result, TimeoutError), repr(self.result)
        assert timeout * 0.9 <= self.seconds < 10


def case(kind: str, *answers: list, mode: str = "read", method: str = "POST", read_timeout: float = READ_TIMEOUT,
         first_pause: float = 0.0, step_pause: float = 0.0, between: float = 0.0, warm_up: bool = False) -> Outcome:
    """One request answered by `answers`, then a normal one on the same client, which must come right. With
    `warm_up`, a normal request first: the case then runs on a kept-alive connection."""
    async def main() -> Outcome:
        async with RawServer(*([None] if warm_up else []), *answers) as server:
            client = Ours(read_timeout) if kind.startswith("ours") else Aio(read_timeout)
            try:
                if warm_up:
                    assert (await client.fetch(server.url, "POST", "read", 0, 0)).body == follow_up_body(0)
                start = time.monotonic()
                try:
                    result = await client.fetch(server.url, method, mode, first_pause, step_pause)
                except (UpstreamError, aiohttp.ClientError) as exc:
                    result = exc
                outcome = Outcome(result, time.monotonic() - start, kind, server)
                await asyncio.sleep(between)
                start = time.monotonic()
                after = await client.fetch(server.url, "POST", "read", 0, 0)
                assert (after.status, after.body) == (200, follow_up_body(len(server.requests) - 1))
                assert time.monotonic() - start < READ_TIMEOUT
            finally:
                await client.close()
            return outcome
    return (uvloop.run if kind.endswith("uvloop") else asyncio.run)(main())
