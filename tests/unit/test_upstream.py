"""The data plane's HTTP client (router/transport/upstream.py) against scripted raw HTTP servers on loopback: its API.
How it stands up to a misbehaving worker, next to aiohttp: test_upstream_adversarial.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from router.transport.upstream import (
    ConnectFailed,
    ConnectionDropped,
    ReadTimeout,
    UpstreamClient,
    UpstreamResponse,
)
from tests.adversarial_server import CLOSE, HANG, RawServer, follow_up_body, head, pattern, with_length

MiB = 1 << 20


def Scripted(*actions) -> RawServer:
    """A server that answers each request with the next action: bytes to send, "close", "hang", or a list of
    pieces sent 50 ms apart (which may end with "close")."""
    def steps(action) -> list:
        if isinstance(action, bytes):
            return [action]
        if not isinstance(action, list):
            return [{"close": CLOSE, "hang": HANG}[action]]
        return [step for piece in action for step in ([CLOSE] if piece == "close" else [piece, 0.05])]
    return RawServer(*(steps(action) for action in actions))


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


def chunked(*chunks: bytes) -> list[bytes]:
    return [head(content_type="text/event-stream", transfer_encoding="chunked"),
            *(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks), b"0\r\n\r\n"]


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_reuses_one_connection_and_sends_body_and_headers():
    async def main():
        async with Scripted(ok(b'{"a":1}'), ok(b'{"b":2}')) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=5)
            first = await client.request("POST", server.url, "/generate", b'{"x":1}', {"x-request-id": "r1"})
            assert (first.status, first.headers["content-type"], await first.read()) == (
                200, "application/json", b'{"a":1}')
            second = await client.request("POST", server.url, "/generate", b"{}")
            assert await second.read() == b'{"b":2}'
            await client.close()
            return server
    server = run(main())
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /generate HTTP/1.1\r\n")
    assert b"x-request-id: r1\r\n" in server.requests[0] and server.requests[0].endswith(b'\r\n\r\n{"x":1}')


def test_chunks_arrive_as_they_are_sent():
    async def main():
        async with Scripted(chunked(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=5)
            response = await client.request("POST", server.url, "/generate", b"{}")
            got = [chunk async for chunk in response.iter_chunks()]
            await client.close()
            return got
    got = run(main())
    assert b"".join(got) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert len(got) == 3  # the server paused between chunks: each was handed on alone


def test_a_kept_alive_connection_the_worker_closed_is_replaced_without_an_error():
    async def main():
        # The server answers, then drops the connection when the next request arrives on it (as an idle timeout
        # racing a new request does); the client must resend on a fresh connection.
        async with Scripted(ok(b"1"), "close", ok(b"2")) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=5)
            assert await (await client.request("POST", server.url, "/g", b"{}")).read() == b"1"
            assert await (await client.request("POST", server.url, "/g", b"{}")).read() == b"2"
            await client.close()
            return server
    server = run(main())
    assert server.connections == 2


def test_connection_refused_is_connect_failed():
    async def main():
        client = UpstreamClient(connect_timeout=2, read_timeout=5)
        with pytest.raises(ConnectFailed):
            await client.request("POST", "http://127.0.0.1:9", "/generate", b"{}")
    run(main())


def test_silence_is_a_read_timeout_and_the_connection_is_not_reused():
    async def main():
        async with Scripted("hang", ok(b"fine")) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=0.3)
            with pytest.raises(ReadTimeout):
                await client.request("POST", server.url, "/g", b"{}")
            assert await (await client.request("POST", server.url, "/g", b"{}")).read() == b"fine"
            await client.close()
            return server
    assert run(main()).connections == 2


def test_a_connection_dropped_mid_body_raises():
    async def main():
        async with Scripted([b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial", "close"]) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=5)
            response = await client.request("POST", server.url, "/g", b"{}")
            with pytest.raises(ConnectionDropped):
                await response.read()
    run(main())


def test_garbage_instead_of_http_is_a_dropped_connection():
    async def main():
        async with Scripted(b"SSH-2.0-OpenSSH\r\n\r\n") as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=5)
            with pytest.raises(ConnectionDropped):
                await client.request("POST", server.url, "/g", b"{}")
    run(main())


def test_interrupt_wakes_a_waiting_reader_with_the_given_error():
    async def main():
        async with Scripted("hang") as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=60)
            sent = []
            waiting = asyncio.ensure_future(client.request("POST", server.url, "/g", b"{}", on_sent=sent.append))
            await asyncio.sleep(0.1)
            sent[0].interrupt(RuntimeError("prefill failed"))
            with pytest.raises(RuntimeError, match="prefill failed"):
                await asyncio.wait_for(waiting, 2)
    run(main())


def test_a_worker_url_with_a_path_prefix_keeps_it():
    async def main():
        async with Scripted(ok(b"{}")) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=5)
            await (await client.request("POST", server.url + "/sglang/", "/generate", b"{}")).read()
            await client.close()
            return server
    assert run(main()).requests[0].startswith(b"POST /sglang/generate HTTP/1.1\r\n")


def test_an_https_worker_is_refused_clearly():
    async def main():
        client = UpstreamClient(connect_timeout=2, read_timeout=5)
        with pytest.raises(ConnectFailed, match="plain http://"):
            await client.request("POST", "https://127.0.0.1:9", "/generate", b"{}")
    run(main())


@pytest.mark.parametrize("size", [MiB + 1, 3 * MiB, 16 * MiB], ids=lambda s: f"{s}B")
def test_a_large_answer_on_a_kept_alive_connection_is_read_whole(size):
    # read() takes nothing before the end: reading must never pause for it.
    body = pattern(size)

    async def main():
        async with RawServer(None, [with_length(body)]) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=3)
            await (await client.request("POST", server.url, "/generate", b"{}")).read()  # a kept-alive connection
            response = await client.request("POST", server.url, "/generate", b"{}")
            assert await asyncio.wait_for(response.read(), 10) == body and response.done
            # And the connection it gave back is reading.
            assert await (await client.request("POST", server.url, "/g", b"{}")).read() == follow_up_body(2)
            await client.close()
            return server
    assert run(main()).connections == 1


def test_an_answer_cut_short_on_a_kept_alive_connection_is_an_error():
    async def main():
        async with RawServer(None, [head(content_length=100) + b"partial", CLOSE]) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=3)
            await (await client.request("POST", server.url, "/generate", b"{}")).read()
            response = await client.request("POST", server.url, "/generate", b"{}")
            with pytest.raises(ConnectionDropped):
                await asyncio.wait_for(response.read(), 5)
            assert isinstance(response.error, ConnectionDropped) and not response.error.before_response
    run(main())


@asynccontextmanager
async def a_body_that_stops(read_timeout: float, read: Callable[[UpstreamResponse], Awaitable],
                            raises: type[BaseException]) -> AsyncIterator[tuple[UpstreamClient, UpstreamResponse]]:
    """A response whose body stops after 7 of its 100 bytes (the worker hangs), read by `read`, which must raise: the
    client and the response, before the client closes."""
    async with RawServer([head(content_length=100) + b"partial", HANG]) as server:
        client = UpstreamClient(connect_timeout=2, read_timeout=read_timeout)
        response = await client.request("POST", server.url, "/generate", b"{}")
        with pytest.raises(raises):
            await read(response)  # and no close(): the client must not keep that connection anyway
        yield client, response
        await client.close()


def test_a_read_timeout_drops_the_connection():
    async def main():
        async with a_body_that_stops(0.3, UpstreamResponse.read, ReadTimeout) as (client, response):
            assert isinstance(response.error, ReadTimeout)
            assert response._conn.transport.is_closing() and not client._idle.get(response._conn.key)
    run(main())


def test_cancelling_a_read_drops_the_connection():
    async def main():
        async with a_body_that_stops(30, lambda response: asyncio.wait_for(response.read(), 0.2), TimeoutError) as (
                _, response):
            assert response._conn.transport.is_closing() and isinstance(response.error, ConnectionDropped)
    run(main())


def test_switching_protocols_is_an_error():
    async def main():
        async with RawServer([head(101, b"Switching Protocols", upgrade="h2c", connection="Upgrade"), HANG]) as server:
            client = UpstreamClient(connect_timeout=2, read_timeout=3)
            with pytest.raises(ConnectionDropped, match="101"):
                await client.request("POST", server.url, "/generate", b"{}")
    run(main())
