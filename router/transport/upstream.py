"""The data plane's HTTP/1.1 client to the workers: keep-alive connections, httptools' parser, asyncio transports.

Why not a general-purpose client: every client request costs the router two upstream requests, and the client
was most of the router's CPU. CPU per request against the same fake worker at concurrency 1/32/256
(bench/README.md, "Router benchmark"): httpx 0.9-5.1 ms, aiohttp 0.12-0.21 ms, pyreqwest 0.05-0.12 ms, this 0.03-0.06.
It does only what the router needs of SGLang's HTTP servers: a request with a bytes body, a response with a
content-length, chunked or close-delimited body, read whole or as it arrives. No TLS, redirects, proxies,
decompression (bytes are relayed as the worker sent them) or HEAD. The parser is httptools (llhttp, as uvicorn uses).
tests/unit/test_upstream_adversarial.py pins its behaviour with huge, slow, cut, reset, interim or malformed
answers, next to aiohttp's on the same cases.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from router.transport.upstream_response import (
    ConnectFailed,
    ConnectionDropped,
    ReadTimeout,
    UpstreamError,
    UpstreamResponse,
)

__all__ = ["ConnectFailed", "ConnectionDropped", "ReadTimeout", "UpstreamClient", "UpstreamError", "UpstreamResponse"]


class _Connection(asyncio.Protocol):
    transport: asyncio.Transport  # set by connection_made, before create_connection hands the connection over

    def __init__(self, client: UpstreamClient, key: tuple[str, int]):
        self.client, self.key = client, key
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.received = False  # a byte of the current response came: the worker has the request, never resend it
        self.paused = self.keep_alive = False
        self.interim = False  # the message being parsed is a 1xx, to be skipped
        self.until_eof = False  # the body being parsed has neither length nor chunks: the worker's close ends it
        self.finished: UpstreamResponse | None = None  # completed by the bytes being parsed right now

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # no request is waiting: whatever this is, the connection can't be trusted
            self.transport.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.response is not None:
                self.response._end(ConnectionDropped(f"malformed response: {exc.__context__ or exc}"))
            self.transport.close()
        if (response := self.finished) is not None:
            # Only now, with every byte of `data` parsed: bytes past the end of the answer closed the connection
            # above, and whoever its end wakes may send the next request on it. A pooled connection must be reading.
            self.finished = None
            self.resume()
            if self.keep_alive and not self.transport.is_closing():
                self.client._release(self)
            else:
                self.transport.close()
            response._end()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._forget(self)
        response, self.response = self.response, None
        if response is not None:  # a close-delimited body ends so (but not with a reset)
            clean_end = exc is None and self.until_eof and response.status
            response._end(None if clean_end else ConnectionDropped(f"connection closed: {exc or 'by the worker'}",
                                                                   not self.received))

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.response is None:
            raise ConnectionDropped("the worker sent more than the answer")

    # The callbacks below run between on_message_begin, which checked there is a response, and the end of a message.
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status, headers = self.parser.get_status_code(), response.headers
        if status < 200:  # 100 Continue, 103 Early Hints: the answer follows; 101 would end HTTP on this connection
            if status == 101:
                raise ConnectionDropped("the worker switched protocols (101)")
            self.interim, response.headers = True, {}
            return
        # As llhttp_message_needs_eof, which httptools does not expose (nor llhttp_finish to tell it of the EOF).
        te = headers.get("transfer-encoding", "").lower()
        self.until_eof = status not in (204, 304) and not te.endswith("chunked") and (
            bool(te) or "content-length" not in headers)
        response.status = status
        response._wake()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.finished, self.response = self.response, None
        self.keep_alive = self.parser.should_keep_alive()


class UpstreamClient:
    """Keep-alive connection pools keyed by worker address. One request per connection at a time (no pipelining)."""

    def __init__(self, connect_timeout: float, read_timeout: float, max_idle_per_worker: int = 1024):
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_idle = max_idle_per_worker
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._addresses: dict[str, tuple[str, int, bytes, str]] = {}

    def _address(self, base_url: str) -> tuple[str, int, bytes, str]:
        """(host, port, Host header, path prefix) of a worker's base URL, parsed once."""
        address = self._addresses.get(base_url)
        if address is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ConnectFailed(f"{base_url}: the data plane speaks plain http:// to workers")
            port = parts.port or 80
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            address = (parts.hostname, port, f"{host}:{port}".encode(), parts.path.rstrip("/"))
            self._addresses[base_url] = address
        return address

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, headers_timeout: float | None = None,
                      on_sent: Callable[[UpstreamResponse], None] | None = None) -> UpstreamResponse:
        """Send the request; return once the response's status and headers are in (ReadTimeout if they take
        longer than `headers_timeout`, default read_timeout). `on_sent` gets the response as soon as the request is
        written, so that another task can interrupt() the wait."""
        host, port, message = self._message(method, base_url, path, body, headers)
        # A kept-alive connection the worker may have closed meanwhile: resent on a new one if so.
        while (conn := self._idle_connection(host, port)) is not None:
            try:
                return await self._exchange(conn, message, headers_timeout, on_sent)
            except ConnectionDropped as exc:
                if not exc.before_response:
                    raise
        return await self._exchange(await self._connect(host, port), message, headers_timeout, on_sent)

    def _idle_connection(self, host: str, port: int) -> _Connection | None:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.transport.is_closing():
                return conn
        return None

    def _send(self, conn: _Connection, message: bytes) -> UpstreamResponse:
        conn.response = response = UpstreamResponse(conn, self.read_timeout)
        conn.received = False
        conn.transport.write(message)
        return response

    def _message(self, method: str, base_url: str, path: str, body: bytes,
                 headers: dict[str, str] | None) -> tuple[str, int, bytes]:
        host, port, host_header, prefix = self._address(base_url)
        head = [f"{method} {prefix}{path} HTTP/1.1\r\n".encode(), b"host: ", host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        return host, port, b"".join(head) + b"\r\n" + body

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self, (host, port)), host, port)
        except TimeoutError:
            raise ConnectFailed(f"connect to {host}:{port} timed out after {self.connect_timeout}s") from None
        except OSError as exc:
            raise ConnectFailed(f"connect to {host}:{port} failed: {exc.strerror or exc}") from None
        self._open.add(conn)
        return conn

    async def _exchange(self, conn: _Connection, message: bytes, headers_timeout: float | None,
                        on_sent: Callable[[UpstreamResponse], None] | None) -> UpstreamResponse:
        response = self._send(conn, message)
        if on_sent is not None:
            on_sent(response)
        await response.wait_headers(headers_timeout)  # failing (or cancelled), it drops the connection
        return response

    def end_exchanges(self, base_url: str, error: Exception) -> int:
        """Interrupt, with `error`, every exchange open with the worker at `base_url` (its connections are dropped);
        return how many there were."""
        try:
            key = self._address(base_url)[:2]
        except (ConnectFailed, ValueError):  # a URL the data plane cannot speak to has nothing open
            return 0
        ended = 0
        for conn in list(self._open):
            response = conn.response
            if conn.key == key and response is not None and not response.done:
                response.interrupt(error)
                ended += 1
        return ended

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.transport.close()

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        for conn in list(self._open):
            conn.transport.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost
