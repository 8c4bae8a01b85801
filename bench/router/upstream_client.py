"""`python -m bench.router.upstream_client`: CPU per upstream request of the router's own data-plane client
(router/transport/upstream.py, "upstream") and aiohttp's ClientSession, on uvloop as in the router, against the FAKE
worker
in another process: a plain 200 JSON answer (~250 B) read whole, and a 16-chunk SSE answer iterated as it arrives,
at concurrency 1 and 64. CPU is this process's (time.process_time: the client and its event loop, nothing else).
Cells are repeated, clients interleaved (in turn first), and the median kept: the machine is shared, and at
concurrency 1 the numbers move by up to 2x from one run to the next.
Writes bench/results/upstream_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import machine, procs
from bench.harness.cpu import wait_for_quiet
from bench.harness.paths import RESULTS

PLAIN = b'{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16}}'
STREAM = b'{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16}, "stream": true}'
HEADERS = {"content-type": "application/json"}
NOTE = ("Both clients as fixed for tests/unit/test_upstream_adversarial.py, which router/transport/upstream.py "
        "passes in every case and aiohttp in all but two (a reset ending a close-delimited body is taken as its end; "
        "an unsolicited answer on an idle connection is handed to the next request). cpu_ms_per_request is the median "
        "of the runs listed; at concurrency 1 a run may move by up to 2x on this shared 2-core machine.")


def client_for(name: str, base: str):
    """(post(body, stream) -> bytes received, close) for one client."""
    if name == "upstream":
        from router.transport.upstream import UpstreamClient

        client = UpstreamClient(connect_timeout=5, read_timeout=600)

        async def post(body: bytes, stream: bool) -> int:
            response = await client.request("POST", base, "/generate", body, HEADERS)
            try:
                if not stream:
                    return len(await response.read())
                return sum([len(chunk) async for chunk in response.iter_chunks()])
            finally:
                response.close()
        return post, client.close
    import aiohttp

    # As a router would set it up: no pool limit, no decompression (bytes are relayed as they came).
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=600))

    async def post(body: bytes, stream: bool) -> int:
        async with session.post(base + "/generate", data=body, headers=HEADERS) as response:
            if not stream:
                return len(await response.read())
            return sum([len(chunk) async for chunk in response.content.iter_any()])
    return post, session.close


async def cell(name: str, base: str, answer: str, concurrency: int, n: int) -> dict:
    post, close = client_for(name, base)
    body, stream = (STREAM, True) if answer == "sse16" else (PLAIN, False)
    gate = asyncio.Semaphore(concurrency)
    received = 0

    async def one():
        nonlocal received
        async with gate:
            got = await post(body, stream)
        received += got
    await asyncio.gather(*(one() for _ in range(min(n, 200))))  # warm the pool
    received = 0
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await close()
    return {"client": name, "answer": answer, "concurrency": concurrency, "requests": n,
            "cpu_ms_per_request": round(1e3 * cpu / n, 4), "req_per_s": round(n / wall, 1),
            "bytes_per_answer": received // n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router.upstream_client", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", default=["upstream", "aiohttp"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests", type=int, default=4000, help="requests per cell and repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "upstream_client.json")
    args = parser.parse_args(argv)
    import uvloop

    busy = wait_for_quiet(60)
    (fake,) = procs.start_fakes(Path(tempfile.mkdtemp(prefix="bench-upstream-")), 16, names=("fake_decode",))
    runs: dict[tuple, list[dict]] = {}
    try:
        for repeat in range(args.repeats):
            for answer in ("plain", "sse16"):
                for conc in args.concurrency:
                    # Interleaved, in turn first: a busy spell, or whatever the run before left behind, hits both.
                    for name in args.clients if repeat % 2 == 0 else args.clients[::-1]:
                        gc.collect()
                        row = uvloop.run(cell(name, fake.url, answer, conc, args.requests))
                        runs.setdefault((name, answer, conc), []).append(row)
                        print(json.dumps(row), flush=True)
    finally:
        fake.stop()
    cells = []
    for rows in runs.values():
        cpu = [r["cpu_ms_per_request"] for r in rows]
        cells.append({**rows[0], "cpu_ms_per_request": statistics.median(cpu), "cpu_ms_per_request_runs": cpu,
                      "req_per_s": statistics.median(r["req_per_s"] for r in rows)})
    cpu = {(c["client"], c["answer"], c["concurrency"]): c["cpu_ms_per_request"] for c in cells}
    ratios = {f"{answer} c{conc}": round(cpu["aiohttp", answer, conc] / cpu["upstream", answer, conc], 1)
              for (name, answer, conc) in cpu if name == "upstream" and ("aiohttp", answer, conc) in cpu}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "experiment": "router/transport/upstream.py vs aiohttp: CPU per upstream request, this process only, uvloop",
        "note": NOTE, "aiohttp_cpu_over_upstream_cpu": ratios,
        "machine": {**machine.machine(), "cores_busy_before_start": busy},
        "cells": sorted(cells, key=lambda c: (c["answer"], c["concurrency"], c["client"]))}, indent=2) + "\n")
    print(f"upstream_client: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
