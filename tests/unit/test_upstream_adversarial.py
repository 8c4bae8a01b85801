"""The data plane's HTTP client (router/transport/upstream.py) against a worker that misbehaves at the byte level.

Every case runs against two clients through one small adapter (tests/upstream_clients.py): ours, and aiohttp's
ClientSession, whose passing proves the case itself right (a case aiohttp cannot pass says so, with why). Ours also
runs on uvloop, as in the router. After every case the SAME client must answer a normal request at once: a connection
left paused, half read or holding stray bytes in the keep-alive pool shows up there. Timeouts are generous: the
machine is busy.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

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
from tests.upstream_clients import BUFFER_BOUND, READ_TIMEOUT, STALL_TIMEOUT, Aio, Got, KiB, MiB, Ours, case


@pytest.fixture(params=["ours-asyncio", "ours-uvloop", "aiohttp-asyncio"])
def kind(request) -> str:
    return request.param


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
