"""`python -m bench.client_probe`: the HTTP client alone. CPU per request of httpx, httpx2, aiohttp's
ClientSession, pyreqwest and the router's own data-plane client (router/upstream.py, "upstream") posting to a FAKE
worker, at concurrency 1, 32 and 256, in one process (no server in the way; process CPU includes any threads).

For httpx and httpx2 it also counts how often the connection pool re-plans (`_assign_requests_to_connections`)
per request, and how many connections the pool ended up with. Writes bench/results/client_probe.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import procs, report
from bench.router import RESULTS, wait_for_quiet

BODY = b'{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16}}'
HEADERS = {"content-type": "application/json"}


def count_pool_passes(module: str) -> dict:
    """Wrap the pool's re-planning method of httpcore (httpx) or httpcore2 (httpx2) with a counter."""
    core = __import__({"httpx": "httpcore", "httpx2": "httpcore2"}[module] + "._async.connection_pool",
                      fromlist=["AsyncConnectionPool"])
    pool_class = core.AsyncConnectionPool
    if hasattr(pool_class, "_bench_counter"):
        return pool_class._bench_counter
    counter, original = {"n": 0}, pool_class._assign_requests_to_connections
    pool_class._bench_counter = counter

    def counted(self):
        counter["n"] += 1
        return original(self)
    pool_class._assign_requests_to_connections = counted
    return counter


async def probe(name: str, url: str, concurrency: int, n: int) -> dict:
    counter, pool_size = None, None
    if name in ("httpx", "httpx2"):
        httpx = __import__(name)
        counter = count_pool_passes(name)
        # As router/app.py sets up its client.
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024))

        async def post():
            response = await client.post(url, content=BODY, headers=HEADERS)
            await response.aread()
    elif name == "upstream":
        from router.upstream import UpstreamClient

        client = UpstreamClient(connect_timeout=5, read_timeout=600)
        base, path = url.rsplit("/", 1)

        async def post():
            response = await client.request("POST", base, "/" + path, BODY, HEADERS)
            await response.read()
    elif name == "pyreqwest":
        from pyreqwest.client import ClientBuilder

        client = ClientBuilder().build()

        async def post():
            response = await client.post(url).body_bytes(BODY).header("content-type", "application/json").build().send()
            await response.bytes()
    else:
        import aiohttp

        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def post():
            async with client.post(url, data=BODY, headers=HEADERS) as response:
                await response.read()
    gate = asyncio.Semaphore(concurrency)

    async def one():
        async with gate:
            await post()
    await asyncio.gather(*(one() for _ in range(min(n, 200))))  # warm the pool
    if counter:
        counter["n"] = 0
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if name in ("httpx", "httpx2"):
        pool_size = len(client._transport._pool.connections)
        await client.aclose()
    elif name == "upstream":
        pool_size = sum(len(idle) for idle in client._idle.values())
        await client.close()
    elif name == "pyreqwest":
        pass  # its pool is inside reqwest
    else:
        pool_size = sum(len(idle) for idle in client.connector._conns.values())  # all idle by now
        await client.close()
    return {"client": name, "concurrency": concurrency, "requests": n, "cpu_ms_per_request": round(1e3 * cpu / n, 3),
            "req_per_s": round(n / wall, 1), "pool_passes_per_request": round(counter["n"] / n, 2) if counter else None,
            "pool_connections_after": pool_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.client_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", default=["httpx", "httpx2", "aiohttp", "pyreqwest", "upstream"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--requests", type=int, default=3000, help="requests per cell")
    parser.add_argument("--out", type=Path, default=RESULTS / "client_probe.json")
    args = parser.parse_args(argv)
    import uvloop

    busy = wait_for_quiet(60)
    fake = procs.start_fake("fake_decode", Path(tempfile.mkdtemp(prefix="bench-client-")), 16)
    rows = []
    try:
        procs.wait_ready(fake, lambda: procs.request(fake.port, "GET", "/health")[0] == 200, 30)
        for name in args.clients:
            for conc in args.concurrency:
                rows.append(uvloop.run(probe(name, f"{fake.url}/generate", conc, args.requests)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        fake.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"experiment": "HTTP client libraries alone against a fake worker",
                                    "machine": {**report.machine(), "cores_busy_before_start": busy},
                                    "cells": rows}, indent=2) + "\n")
    print(f"client_probe: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
