"""The router's uvicorn protocol: a plain answer leaves in one write; a stream's head leaves before its first chunk."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from router.one_write import OneWriteProtocol


class RecordingTransport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def connect(app) -> tuple[OneWriteProtocol, RecordingTransport]:
    config = uvicorn.Config(app, http=OneWriteProtocol, lifespan="off")
    config.load()
    protocol = OneWriteProtocol(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def plain_app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"11")]})
    await send({"type": "http.response.body", "body": b'{"text":""}'})


def test_a_plain_answer_is_one_write_and_the_connection_stays_usable():
    async def scenario():
        protocol, transport = connect(plain_app)
        request = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
        protocol.data_received(request)
        await settle()
        assert len(transport.writes) == 1
        assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert transport.writes[0].endswith(b'\r\n\r\n{"text":""}')
        protocol.data_received(request)  # kept alive: the next request gets its own single write
        await settle()
        assert len(transport.writes) == 2 and transport.writes[1].endswith(b'{"text":""}')
        assert not transport.closed
    asyncio.run(scenario())


def test_a_stream_sends_its_head_before_the_first_chunk():
    first_chunk = asyncio.Event()

    async def stream_app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await first_chunk.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def scenario():
        protocol, transport = connect(stream_app)
        protocol.data_received(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        await settle()
        assert len(transport.writes) == 1 and b"transfer-encoding: chunked" in transport.writes[0]
        first_chunk.set()
        await settle()
        assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]
    asyncio.run(scenario())


def test_a_head_request_gets_its_head_and_a_broken_app_gets_a_500():
    async def broken_app(scope, receive, send):
        raise RuntimeError("boom")

    async def scenario():
        protocol, transport = connect(plain_app)
        protocol.data_received(b"HEAD /generate HTTP/1.1\r\nhost: x\r\n\r\n")
        await settle()
        assert len(transport.writes) == 1 and b"content-length: 11" in transport.writes[0]
        protocol, transport = connect(broken_app)
        protocol.data_received(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        await settle()
        assert len(transport.writes) == 1
        assert transport.writes[0].startswith(b"HTTP/1.1 500") and transport.writes[0].endswith(b"Internal Server Error")
    asyncio.run(scenario())


def test_a_100_continue_goes_out_at_once_and_the_answer_after_it_in_one_write():
    async def scenario():
        protocol, transport = connect(plain_app)
        protocol.data_received(b"POST /generate HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
        await settle()
        assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        protocol.data_received(b"{}")
        await settle()
        assert len(transport.writes) == 2 and transport.writes[1].startswith(b"HTTP/1.1 200 OK\r\n")
        assert transport.writes[1].endswith(b'{"text":""}')
    asyncio.run(scenario())
