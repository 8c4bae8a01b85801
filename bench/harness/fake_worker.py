"""A FAKE SGLang worker for benchmarks: answers at once, never runs a model.

It speaks just enough of SGLang's HTTP API for a PD router to treat it as a prefill or a decode server:
POST /generate, /v1/completions, /v1/chat/completions (a plain JSON answer, or with `"stream": true` N SSE
chunks `data: {...}` then `data: [DONE]`, in chunked transfer encoding), GET /health, POST /abort_request,
GET /get_model_info, /v1/models, /get_server_info. The text it "generates" is a constant. It is a hand-written
HTTP/1.1 server on bare asyncio (uvloop when installed), keep-alive included, so that it costs far less CPU per
request than the routers under test. GET /fake_stats (not SGLang) counts the requests it has seen.

    python -m bench.harness.fake_worker --port 31000 --chunks 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time

try:
    import orjson

    dumps, loads = orjson.dumps, orjson.loads
except ImportError:  # pragma: no cover - orjson is a dependency of sglang
    def dumps(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    loads = json.loads

MODEL = "fake-model"
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 411: b"Length Required"}
# No model_path/tokenizer_path on purpose: given one, SGLang's Rust router tries to fetch its tokenizer from the
# Hugging Face hub at start-up, and this benchmark must make no traffic off the machine.
_INFO = {"is_generation": True, "version": "fake"}
_GET_JSON = {
    "/model_info": _INFO, "/get_model_info": _INFO, "/server_info": _INFO, "/get_server_info": _INFO,
    "/v1/models": {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "fake"}]},
}


class Stats:
    def __init__(self) -> None:
        self.paths: dict[str, int] = {}
        self.with_bootstrap = 0  # requests whose body carried bootstrap_room (i.e. came through a PD router)


def _response(status: int, body: bytes, content_type: bytes = b"application/json", close: bool = False) -> bytes:
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
        status, _REASONS.get(status, b"OK"), content_type, len(body))
    return head + (b"connection: close\r\n\r\n" if close else b"\r\n") + body


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _events(path: str, rid, chunks: int) -> list[bytes]:
    """The SSE events of one streamed answer, in the shape SGLang uses on each path."""
    out = []
    for i in range(chunks):
        if path == "/generate":
            obj = {"text": "x" * (i + 1), "output_ids": list(range(i + 1)),
                   "meta_info": {"id": rid, "completion_tokens": i + 1,
                                 "finish_reason": {"type": "length", "length": chunks} if i == chunks - 1 else None}}
        else:
            delta = {"delta": {"content": "x"}} if path == "/v1/chat/completions" else {"text": "x"}
            obj = {"id": rid, "object": "chat.completion.chunk" if "chat" in path else "text_completion",
                   "model": MODEL, "choices": [{"index": 0, **delta,
                                                "finish_reason": "length" if i == chunks - 1 else None}]}
        out.append(b"data: " + dumps(obj) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def _plain(path: str, rid, chunks: int) -> bytes:
    if path == "/generate":
        return dumps({"text": "x" * chunks, "output_ids": list(range(chunks)),
                      "meta_info": {"id": rid, "prompt_tokens": 4, "completion_tokens": chunks, "cached_tokens": 0,
                                    "finish_reason": {"type": "length", "length": chunks}, "e2e_latency": 0.0}})
    usage = {"prompt_tokens": 4, "completion_tokens": chunks, "total_tokens": 4 + chunks}
    choice = ({"message": {"role": "assistant", "content": "x" * chunks}} if "chat" in path else {"text": "x" * chunks})
    return dumps({"id": rid, "object": "chat.completion" if "chat" in path else "text_completion",
                  "created": int(time.time()), "model": MODEL,
                  "choices": [{"index": 0, **choice, "finish_reason": "length"}], "usage": usage})


class FakeSGLang(asyncio.Protocol):
    def __init__(self, chunks: int, stats: Stats) -> None:
        self.chunks, self.stats, self.buf, self.transport = chunks, stats, b"", None

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # asyncio and uvloop set it already; make sure, as Nagle would delay stream chunks
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None:  # keep-alive (and pipelining): answer every complete request buffered
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            method, target, version = [*lines[0].split(" "), "", ""][:3]
            if method == "PRI":  # an HTTP/2 prior-knowledge probe (SGLang's Rust router sends one): HTTP/1.1 only
                self.transport.close()
                self.transport = None
                return
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._reply(_response(411, b'{"error":"chunked request bodies are not supported"}', close=True),
                            True)
                return
            size = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + size:
                return
            body, self.buf = self.buf[end + 4:end + 4 + size], self.buf[end + 4 + size:]
            close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
            self._handle(method, target.split("?", 1)[0], body, close)

    def _reply(self, data: bytes, close: bool) -> None:
        self.transport.write(data)
        if close:
            self.transport.close()
            self.transport = None

    def _handle(self, method: str, path: str, body: bytes, close: bool) -> None:
        stats = self.stats
        if path not in stats.paths:
            print(f"[fake_worker] first {method} {path}", file=sys.stderr, flush=True)
        stats.paths[path] = stats.paths.get(path, 0) + 1
        if method == "GET" and path == "/health":
            return self._reply(_response(200, b""), close)
        if method == "GET" and path in _GET_JSON:
            return self._reply(_response(200, dumps(_GET_JSON[path])), close)
        if method == "GET" and path == "/fake_stats":
            return self._reply(_response(200, dumps({"paths": stats.paths, "with_bootstrap": stats.with_bootstrap})),
                               close)
        if method == "POST" and path == "/abort_request":
            return self._reply(_response(200, b"{}"), close)
        if method != "POST" or path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
            return self._reply(_response(404, b'{"error":"not found"}'), close)
        try:
            request = loads(body)
        except ValueError:
            return self._reply(_response(400, b'{"error":"body is not JSON"}'), close)
        if "bootstrap_room" in request:
            stats.with_bootstrap += 1
        rid = request.get("rid") or "fake"
        if not request.get("stream"):
            return self._reply(_response(200, _plain(path, rid, self.chunks)), close)
        # Every chunk at once, as one HTTP chunk each, handed to the kernel in one writev: they would leave
        # back-to-back anyway, and a write() each would make the fake, not the routers, the limit of the
        # direct-to-decode stream cells.
        self.transport.writelines([
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n",
            *(_http_chunk(event) for event in _events(path, rid, self.chunks)), b"0\r\n\r\n"])
        if close:
            self.transport.close()
            self.transport = None


async def serve(host: str, port: int, chunks: int) -> None:
    stats = Stats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FakeSGLang(chunks, stats), host, port, backlog=4096, reuse_address=True)
    print(f"[fake_worker] FAKE SGLang worker on http://{host}:{port} ({chunks} chunks a stream)", file=sys.stderr,
          flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.harness.fake_worker", description="A FAKE SGLang worker.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=16, help="SSE chunks in a streamed answer (and tokens)")
    args = parser.parse_args(argv)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve(args.host, args.port, args.chunks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
