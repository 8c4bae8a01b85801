"""`python -m bench.asgi_overhead`: CPU per request of the ASGI application layer alone, no network, no server.

Calls an app directly with a synthetic HTTP scope (what uvicorn would pass) and measures process CPU time per
request: a bare ASGI function (the floor), Starlette, and FastAPI with its built-in OpenTelemetry hooks on (the
default in FastAPI 0.165) and off, each answering a plain JSON body or a 16-chunk StreamingResponse. Being CPU time
in one process, the numbers hold up on a shared machine. Writes bench/results/asgi_overhead.json.
"""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bench.relay import NO_TELEMETRY
from bench.router import RESULTS

BODY = b'{"text": "The capital of France is", "stream": false}'
ANSWER = b'{"text": "xxxxxxxxxxxxxxxx", "output_ids": [0, 1, 2, 3], "meta_info": {"id": "r"}}'
CHUNKS = [b'data: {"text": "x"}\n\n'] * 16 + [b"data: [DONE]\n\n"]


def apps() -> dict:
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from starlette.applications import Starlette
    from starlette.routing import Route

    async def chunks():
        for chunk in CHUNKS:
            yield chunk

    async def endpoint(request: Request):
        body = await request.body()
        if b'"stream": true' in body:
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return Response(ANSWER, media_type="application/json")

    async def bare(scope, receive, send):
        message = await receive()
        stream = b'"stream": true' in message["body"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream" if stream else b"application/json")]})
        for chunk in (CHUNKS if stream else [ANSWER]):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    built = {"bare ASGI function": bare,
             "starlette": Starlette(routes=[Route("/generate", endpoint, methods=["POST"])])}
    for name, telemetry in (("fastapi (telemetry on, the default)", None), ("fastapi (telemetry off)", NO_TELEMETRY)):
        app = FastAPI(telemetry=telemetry)
        app.post("/generate")(endpoint)
        built[name] = app
    return built


async def drive(app, stream: bool, n: int) -> float:
    body = BODY.replace(b"false", b"true") if stream else BODY
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/generate", "raw_path": b"/generate", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}

    statuses = set()

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.add(message["status"])
    for i in range(n + 200):
        if i == 200:  # after a warm-up
            started = time.process_time()
        sent = [False]

        async def receive():
            if sent[0]:
                await asyncio.sleep(3600)  # the client never disconnects
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await app(dict(scope), receive, send)
    if statuses != {200}:
        raise RuntimeError(f"the app answered {statuses}")
    return 1000 * (time.process_time() - started) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.asgi_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--out", type=Path, default=RESULTS / "asgi_overhead.json")
    args = parser.parse_args(argv)
    import uvloop

    rows = []
    for name, app in apps().items():
        for stream in (False, True):
            ms = uvloop.run(drive(app, stream, args.requests))
            rows.append({"app": name, "mode": "stream" if stream else "plain", "cpu_ms_per_request": round(ms, 4)})
            print(f"{name:38} {rows[-1]['mode']:7} {ms:.4f} ms CPU/request", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"experiment": "ASGI app layer alone (no server, no network)", "rows": rows},
                                   indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
