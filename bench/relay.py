"""A minimal PD relay, for the experiment in bench/relay_experiment.py only: NOT our router.

It does what router/dispatch.py does on the happy path (inject bootstrap_host/port/room and rid, POST the same
body to a prefill and a decode at once, answer with the decode's body or relay its SSE stream chunk by chunk,
let the prefill's answer finish in the background), with a choice of HTTP server (FastAPI or bare ASGI on uvicorn, aiohttp's server) and HTTP client, so their
costs can be compared with each other and with the real router. No validation, no failure handling.

    python -m bench.relay --server fastapi --client httpx --port P --prefill URL --decode URL
"""


import argparse
import asyncio
import json
import secrets
import sys
import uuid

BACKGROUND: set[asyncio.Task] = set()


def inject(raw: bytes, prefill_url: str) -> bytes:
    body = json.loads(raw)
    body["bootstrap_host"], body["bootstrap_port"] = "127.0.0.1", 8999
    body["bootstrap_room"] = secrets.randbits(63)
    body.setdefault("rid", uuid.uuid4().hex)
    return json.dumps(body).encode()


def _background(coro) -> None:
    task = asyncio.create_task(coro)
    BACKGROUND.add(task)
    task.add_done_callback(BACKGROUND.discard)


class HttpxClient:
    """httpx.AsyncClient set up as router/app.py sets it up (`module` may be httpx2, the pydantic fork)."""

    def __init__(self, module: str = "httpx") -> None:
        httpx = __import__(module)
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
                                        timeout=httpx.Timeout(600, connect=5))

    async def _drain(self, url: str, data: bytes) -> None:
        async with self.client.stream("POST", url, content=data, headers={"content-type": "application/json"}) as r:
            await r.aread()

    async def pd(self, prefill: str, decode: str, data: bytes, stream: bool):
        """Return (status, content-type, body bytes or async iterator of chunks)."""
        _background(self._drain(prefill, data))
        request = self.client.build_request("POST", decode, content=data, headers={"content-type": "application/json"})
        response = await self.client.send(request, stream=True)
        ctype = response.headers.get("content-type", "application/json")
        if not stream:
            return response.status_code, ctype, await response.aread()

        async def chunks():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
        return response.status_code, ctype, chunks()


class AiohttpClient:
    def __init__(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=600),
                                             auto_decompress=False)

    async def _drain(self, url: str, data: bytes) -> None:
        async with self.session.post(url, data=data, headers={"content-type": "application/json"}) as r:
            await r.read()

    async def pd(self, prefill: str, decode: str, data: bytes, stream: bool):
        _background(self._drain(prefill, data))
        response = await self.session.post(decode, data=data, headers={"content-type": "application/json"})
        ctype = response.headers.get("content-type", "application/json")
        if not stream:
            async with response:
                return response.status, ctype, await response.read()

        async def chunks():
            async with response:
                async for chunk in response.content.iter_any():
                    yield chunk
        return response.status, ctype, chunks()


# FastAPI 0.165 checks OpenTelemetry's global providers on every request unless its telemetry is switched off.
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


def fastapi_app(client_factory, prefill: str, decode: str, telemetry: bool = True):
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    app, state = FastAPI(telemetry=None if telemetry else NO_TELEMETRY), {}

    @app.post("/generate")
    async def generate(request: Request):
        if "client" not in state:
            state["client"] = client_factory()
        raw = await request.body()
        data = inject(raw, prefill)
        stream = b'"stream": true' in raw or b'"stream":true' in raw
        status, ctype, body = await state["client"].pd(prefill + "/generate", decode + "/generate", data, stream)
        if stream:
            return StreamingResponse(body, status_code=status, media_type=ctype)
        return Response(body, status_code=status, media_type=ctype)
    return app


def aiohttp_app(client_factory, prefill: str, decode: str):
    from aiohttp import web

    state = {}

    async def generate(request: web.Request) -> web.StreamResponse:
        if "client" not in state:
            state["client"] = client_factory()
        raw = await request.read()
        stream = b'"stream": true' in raw or b'"stream":true' in raw
        status, ctype, body = await state["client"].pd(prefill + "/generate", decode + "/generate",
                                                       inject(raw, prefill), stream)
        if not stream:
            return web.Response(body=body, status=status, headers={"content-type": ctype})
        response = web.StreamResponse(status=status, headers={"content-type": ctype})
        await response.prepare(request)
        async for chunk in body:
            await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


class PyreqwestClient:
    def __init__(self) -> None:
        from pyreqwest.client import ClientBuilder

        self.client = ClientBuilder().build()

    async def _drain(self, url: str, data: bytes) -> None:
        response = await self.client.post(url).body_bytes(data).header("content-type", "application/json").build().send()
        await response.bytes()

    async def pd(self, prefill: str, decode: str, data: bytes, stream: bool):
        _background(self._drain(prefill, data))
        if not stream:
            r = await self.client.post(decode).body_bytes(data).header("content-type", "application/json").build().send()
            return r.status, r.headers.get("content-type", "application/json"), await r.bytes()
        cm = self.client.post(decode).body_bytes(data).header("content-type", "application/json").build_streamed()
        r = await cm.__aenter__()

        async def chunks():
            try:
                while (chunk := await r.body_reader.read_chunk()) is not None:
                    yield bytes(chunk)
            finally:
                await cm.__aexit__(None, None, None)
        return r.status, r.headers.get("content-type", "application/json"), chunks()


class UpstreamRelayClient:
    """The router's own data-plane client (router/upstream.py), without the router around it."""

    def __init__(self) -> None:
        from router.upstream import UpstreamClient

        self.client = UpstreamClient(connect_timeout=5, read_timeout=600)

    async def _drain(self, url: str, data: bytes) -> None:
        base, path = url.rsplit("/", 1)
        await (await self.client.request("POST", base, "/" + path, data, {"content-type": "application/json"})).read()

    async def pd(self, prefill: str, decode: str, data: bytes, stream: bool):
        _background(self._drain(prefill, data))
        base, path = decode.rsplit("/", 1)
        response = await self.client.request("POST", base, "/" + path, data, {"content-type": "application/json"})
        ctype = response.headers.get("content-type", "application/json")
        if not stream:
            return response.status, ctype, await response.read()
        return response.status, ctype, response.iter_chunks()


def asgi_app(client_factory, prefill: str, decode: str):
    """A bare ASGI function: no framework between uvicorn and the relay."""
    state = {}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if "client" not in state:
            state["client"] = client_factory()
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        stream = b'"stream": true' in raw or b'"stream":true' in raw
        status, ctype, body = await state["client"].pd(prefill + "/generate", decode + "/generate",
                                                       inject(raw, prefill), stream)
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype.encode())]})
        if not stream:
            await send({"type": "http.response.body", "body": body})
            return
        async for chunk in body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    return app


CLIENTS = {"httpx": lambda: HttpxClient("httpx"), "httpx2": lambda: HttpxClient("httpx2"), "aiohttp": AiohttpClient,
           "pyreqwest": PyreqwestClient, "upstream": UpstreamRelayClient}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay")
    servers = ["asgi-httptools", "fastapi", "fastapi-httptools", "fastapi-notelemetry", "fastapi-httptools-notelemetry", "aiohttp"]
    parser.add_argument("--server", choices=servers, required=True)
    parser.add_argument("--client", choices=sorted(CLIENTS), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args(argv)
    if args.server == "aiohttp":
        import uvloop
        from aiohttp import web

        uvloop.install()
        web.run_app(aiohttp_app(CLIENTS[args.client], args.prefill, args.decode), host="127.0.0.1",
                    port=args.port, access_log=None, print=None)
        return 0
    import uvicorn

    http = "httptools" if "httptools" in args.server else "h11"  # explicit: "auto" picks httptools when installed
    if args.server == "asgi-httptools":
        app = asgi_app(CLIENTS[args.client], args.prefill, args.decode)
    else:
        app = fastapi_app(CLIENTS[args.client], args.prefill, args.decode, telemetry="notelemetry" not in args.server)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, http=http, loop="uvloop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
