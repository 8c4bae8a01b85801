"""The data plane's HTTP client (router/upstream.py) against a worker that misbehaves at the byte level.

Every case runs against two clients through one small adapter: ours, and aiohttp's ClientSession, whose passing
proves the case itself right (a case aiohttp cannot pass says so, with why). Ours also runs on uvloop, as in the
router. After every case the SAME client must answer a normal request at once: a connection left paused, half
read or holding stray bytes in the keep-alive pool shows up there. Timeouts are generous: the machine is busy.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import pytest
import uvloop

from router.upstream import UpstreamClient, UpstreamError
from router.upstream_response import PAUSE_ABOVE
from tests.adversarial_server import (
    CLOSE,
    HANG,
    RESET,
    IdleClose,
    RawServer,
    chunked,
    close_delimited,
    follow_up_body,
    head,
    pattern,
    with_length,
)

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


@pytest.fixture(params=["ours-asyncio", "ours-uvloop", "aiohttp-asyncio"])
def kind(request) -> str:
    return request.param


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


# Bodies: every size around the pause threshold, every framing, read whole and iterated.

SIZES = [0, 1, 64 * KiB, MiB, MiB + 1, 3 * MiB, 16 * MiB]
FRAMINGS = {
    "length": lambda body: [with_length(body)],
    "many-small-chunks": lambda body: [chunked(body, 4 * KiB)],
    "few-huge-chunks": lambda body: [chunked(body, len(body) // 3 + 1)],
    "close-delimited": lambda body: [close_delimited(body), CLOSE],
}


@pytest.mark.parametrize("mode", ["read", "iter"])
@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s}B")
def test_bodies_of_every_size_and_framing(kind, size, framing, mode):
    body = pattern(size)
    wire, *rest = FRAMINGS[framing](body)
    cut = wire.index(b"\r\n\r\n") + 5  # the head and a byte, then the rest: the iterating consumer is behind
    outcome = case(kind, [wire[:cut], 0.02, wire[cut:], *rest], mode=mode, first_pause=0.05)
    got = outcome.answered(body)
    # A complete kept-alive answer gives its connection back; a close-delimited one cannot.
    assert outcome.server.connections == (2 if framing == "close-delimited" else 1)
    if outcome.ours and mode == "iter":
        assert max(got.pieces, default=0) <= BUFFER_BOUND


def test_a_body_that_ends_while_reading_is_paused_leaves_a_reading_connection_in_the_pool(kind):
    # The last 10 bytes push the buffer over the threshold and end the answer in one read, while its consumer
    # sleeps; meanwhile another request takes that connection from the pool: it must be answered at once, not
    # when the first consumer wakes up.
    body = pattern(MiB + 10)
    wire = with_length(body)
    start = wire.index(b"\r\n\r\n") + 4

    async def main():
        async with RawServer([wire[:start + 1], 0.05, wire[start + 1:-10], 0.05, wire[-10:]]) as server:
            client = Ours(READ_TIMEOUT) if kind.startswith("ours") else Aio(READ_TIMEOUT)
            ended = {}

            async def fetch(name: str, delay: float, first_pause: float) -> Got:
                await asyncio.sleep(delay)
                got = await client.fetch(server.url, "POST", "iter", first_pause, 0)
                ended[name] = time.monotonic()
                return got
            try:
                slow, other = await asyncio.gather(fetch("slow", 0, 2.5), fetch("other", 0.8, 0))
            finally:
                await client.close()
            assert slow.body == body and other.body == follow_up_body(1)
            assert ended["other"] < ended["slow"] - 0.5
            return server
    server = (uvloop.run if kind.endswith("uvloop") else asyncio.run)(main())
    if kind.startswith("ours"):  # (aiohttp stops reading before the end for its sleeper: a 2nd connection)
        assert server.connections == 1


def test_a_slow_reader_of_a_huge_stream_gets_it_all_with_bounded_memory(kind):
    body = pattern(16 * MiB)
    outcome = case(kind, [chunked(body, 64 * KiB)], mode="iter", step_pause=0.005)
    got = outcome.answered(body)
    if outcome.ours:
        assert max(got.pieces) <= BUFFER_BOUND
    assert outcome.server.connections == 1


# A worker that stalls: a ReadTimeout within the read timeout, and a connection that is not reused.

STALLS = {  # where the worker falls silent, and how the client is reading then
    "before-the-head": ([HANG], "read"),
    "after-the-head": ([head(content_length=100), HANG], "iter"),
    "mid-body": ([head(content_length=100) + b"x" * 50, HANG], "read"),
    "mid-chunks": ([chunked(b"x" * 100, 10)[:-30], HANG], "iter"),
}


@pytest.mark.parametrize("where", STALLS)
def test_a_stalled_worker_is_a_read_timeout(kind, where):
    answer, mode = STALLS[where]
    outcome = case(kind, answer, mode=mode, read_timeout=STALL_TIMEOUT)
    outcome.timed_out(STALL_TIMEOUT)
    assert outcome.server.connections == 2


# A worker that vanishes (FIN) or resets (RST) at any byte: an error, never a shorter body taken as complete.

def _offsets() -> dict[str, bytes]:
    fixed = with_length(pattern(1000), x_extra="1")
    fixed_head = fixed.index(b"\r\n\r\n") + 4
    framed = chunked(pattern(900), 300)
    chunks_at = framed.index(b"\r\n\r\n") + 4
    return {
        "status-line": fixed[:5], "status-code": fixed[:12], "header-name": fixed[:fixed.index(b"x-extra") + 3],
        "header-value": fixed[:fixed.index(b"x-extra") + 9], "before-head-end": fixed[:fixed_head - 2],
        "length-0-of-1000": fixed[:fixed_head], "length-500-of-1000": fixed[:fixed_head + 500],
        "length-999-of-1000": fixed[:-1],
        "chunk-size-line": framed[:chunks_at + 1], "chunk-size-no-lf": framed[:chunks_at + 4],
        "mid-chunk": framed[:chunks_at + 5 + 150], "chunk-before-crlf": framed[:chunks_at + 5 + 300],
        "before-last-chunk": framed[:-5], "in-last-chunk": framed[:-4], "before-final-crlf": framed[:-2],
        "close-delimited-head": close_delimited(b"")[:-3],
    }


OFFSETS = _offsets()


@pytest.mark.parametrize("mode", ["read", "iter"])
@pytest.mark.parametrize("where", OFFSETS)
def test_a_worker_that_closes_mid_answer_is_an_error(kind, where, mode):
    outcome = case(kind, [OFFSETS[where], CLOSE], mode=mode)
    outcome.broken()
    assert outcome.server.connections == 2


@pytest.mark.parametrize("where", ["status-line", "header-value", "length-500-of-1000", "mid-chunk",
                                   "before-final-crlf", "close-delimited-body"])
def test_a_worker_that_resets_mid_answer_is_an_error(kind, where, request):
    if where == "close-delimited-body" and kind.startswith("aiohttp"):
        request.applymarker(pytest.mark.xfail(strict=True, reason="aiohttp ends a close-delimited body at any "
                                                                  "connection loss, a reset included"))
    sent = close_delimited(pattern(1000)) if where == "close-delimited-body" else OFFSETS[where]
    outcome = case(kind, [sent, 0.05, RESET])
    outcome.broken()
    assert outcome.server.connections == 2


def test_a_kept_alive_connection_closed_after_part_of_an_answer_is_an_error_not_a_resend(kind):
    # The worker had the request (a byte of an answer came): sending it again could run it twice.
    outcome = case(kind, [b"HTTP/1.", CLOSE], warm_up=True)
    outcome.broken()
    assert len(outcome.server.requests) == 3  # the warm-up, this one once, the follow-up


def test_a_close_delimited_body_ends_at_the_close_even_when_empty(kind):
    outcome = case(kind, [close_delimited(b""), CLOSE], mode="iter")
    outcome.answered(b"")


# Interim (1xx) answers come before the real one.

@pytest.mark.parametrize("together", [False, True], ids=["apart", "in-one-write"])
def test_interim_answers_are_skipped(kind, together):
    interim = [head(100, b"Continue"), head(103, b"Early Hints", link="</style.css>; rel=preload"),
               head(100, b"Continue")]
    final = with_length(b'{"final": true}', x_final="yes")
    steps = [b"".join(interim) + final] if together else [interim[0], 0.02, interim[1], 0.02, interim[2], 0.02, final]
    got = case(kind, steps).answered(b'{"final": true}')
    assert got.headers["x-final"] == "yes" and "link" not in got.headers


def test_switching_protocols_is_never_taken_for_the_answer(kind):
    outcome = case(kind, [head(101, b"Switching Protocols", upgrade="websocket", connection="Upgrade")
                          + with_length(b"not the answer"), 0.05, CLOSE])
    if outcome.ours:
        outcome.broken()
    else:  # aiohttp hands a 101 on as the answer, for the caller to upgrade: not a 200 either
        assert isinstance(outcome.result, Exception) or outcome.result.status == 101


# Malformed answers: an error, and the connection is dropped.

MALFORMED = {
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "bad-status": b"HTTP/1.1 2x0 OK\r\ncontent-length: 2\r\n\r\nok",
    "bad-version": b"HTTP/7.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    "header-without-colon": b"HTTP/1.1 200 OK\r\nnot a header\r\ncontent-length: 2\r\n\r\nok",
    "bad-content-length": b"HTTP/1.1 200 OK\r\ncontent-length: 2x\r\n\r\nok",
    "two-content-lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok!",
    "bad-chunk-size": head(transfer_encoding="chunked") + b"zz\r\nok\r\n0\r\n\r\n",
    "chunk-longer-than-said": head(transfer_encoding="chunked") + b"2\r\nokay\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("what", MALFORMED)
def test_a_malformed_answer_is_an_error(kind, what):
    outcome = case(kind, [MALFORMED[what], 0.05, CLOSE])
    outcome.broken()
    assert outcome.server.connections == 2


def test_bytes_after_the_answer_are_not_taken_for_the_next_one(kind):
    # One answer, and straight after it in the same write, a second nobody asked for.
    outcome = case(kind, [with_length(b"first") + with_length(b"unasked")])
    outcome.answered(b"first")
    assert outcome.server.connections == 2


def test_an_answer_on_an_idle_connection_is_not_taken_for_the_next_one(kind, request):
    if kind.startswith("aiohttp"):
        request.applymarker(pytest.mark.xfail(strict=True, reason="aiohttp keeps an idle connection that received "
                                              "an unsolicited answer, and hands that answer to the next request"))
    outcome = case(kind, [with_length(b"first"), 0.1, with_length(b"unasked")], between=0.6)
    outcome.answered(b"first")
    assert outcome.server.connections == 2


# Kept-alive connections the worker closes.

def test_a_connection_the_worker_closed_while_idle_is_replaced(kind):
    outcome = case(kind, [with_length(b"first"), IdleClose(0.05)], between=0.5)
    outcome.answered(b"first")
    assert outcome.server.connections == 2


def test_a_connection_the_worker_closes_as_the_next_request_arrives_is_replaced_transparently(kind):
    # The race an idle timeout makes: the request is written on a connection the worker is closing, not a byte
    # comes back; it is resent on a new connection. (GET: aiohttp resends only idempotent requests.)
    async def main():
        async with RawServer([with_length(b"first")], [CLOSE]) as server:
            client = Ours(READ_TIMEOUT) if kind.startswith("ours") else Aio(READ_TIMEOUT)
            try:
                assert (await client.fetch(server.url, "GET", "read", 0, 0)).body == b"first"
                got = await client.fetch(server.url, "GET", "read", 0, 0)
                assert got.body == follow_up_body(2)
            finally:
                await client.close()
            return server
    server = (uvloop.run if kind.endswith("uvloop") else asyncio.run)(main())
    assert server.connections == 2 and len(server.requests) == 3
