"""`python -m bench.profile_router`: where does our router spend its CPU under load? (py-spy, on FAKE workers)

Starts the fakes and our router (as bench.router does), drives it with wrk at one concurrency and mode, samples
the router with `py-spy record` meanwhile, and sorts every on-CPU sample into who is paying: the HTTP client
(httpx/httpcore, aiohttp, or the router's own router/upstream.py), the HTTP server (uvicorn/h11/starlette/
fastapi), our own code (and what it calls), the event loop. Writes bench/results/profile_router_c<C>_<mode>.json (the breakdown and the hottest frames).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench import loadgen, procs
from bench.router import RESULTS

CLIENT, SERVER = ("httpx/", "httpcore/"), ("uvicorn/", "starlette/", "fastapi/", "h11/")
# What only httpcore uses anyio for here (its sockets); py-spy often sees such coroutine frames without their
# callers, when uvloop's C code is between them and the root.
ANYIO_SOCKETS = ("anyio/abc/_sockets.py", "anyio/_core/_typedattr.py")
OURS = ("router/", "pdcluster/")
ENTRY = "router/__main__.py"  # uvicorn.run is called from here: not our code's cost


def _file(frame: str) -> str:
    return frame[frame.rfind("(") + 1:].rsplit(":", 1)[0]


def category(frames: list[str]) -> str:
    """Who pays for one sample (frames root first)."""
    files = [_file(f) for f in frames]
    if any(f.startswith(CLIENT) or f in ANYIO_SOCKETS for f in files) or any(
            f.startswith("SocketStream.") for f in frames):
        return "client: httpx/httpcore (with anyio, h11 underneath)"
    if any(f.startswith("aiohttp/") for f in files):
        return "client: aiohttp"
    if "router/upstream.py" in files:
        return "client: router/upstream.py"
    ours = [i for i, f in enumerate(files) if f.startswith(OURS) and f != ENTRY]
    if ours:
        below = files[ours[-1] + 1:]
        return "our code itself" if not below else f"our code calling {below[0].split('/')[0].removesuffix('.py')}"
    if any(f.startswith(SERVER) for f in files):
        return "server: uvicorn/h11/starlette/fastapi"
    if any(f.startswith(("asyncio/", "uvloop/")) or "uvloop" in f for f in files):
        return "event loop (asyncio/uvloop)"
    return f"other: {files[-1].split('/')[0] if files else '?'}"


def summarize(raw: Path, top: int = 25) -> dict:
    cats, incl, leaf, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        frames = [f for f in frames if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        cats[category(frames)] += n
        leaf[frames[-1]] += n
        for frame in set(frames):
            incl[frame] += n

    def pct(counter: collections.Counter, k: int) -> list:
        return [[round(100 * n / max(total, 1), 1), f] for f, n in counter.most_common(k)]
    return {"samples": total, "by_category_pct": dict((f, p) for p, f in pct(cats, 20)),
            "top_inclusive_pct": pct(incl, top), "top_self_pct": pct(leaf, top)}


def upstream_connections(router: procs.Proc, ports: tuple[int, ...]) -> dict:
    """How many TCP connections the router holds to the workers (its HTTP client's pool), by state."""
    import psutil

    states: collections.Counter = collections.Counter()
    for conn in psutil.Process(router.popen.pid).net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port in ports:
            states[conn.status] += 1
    return dict(states)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_router", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--mode", choices=["plain", "stream"], default="plain")
    parser.add_argument("--duration", type=int, default=8, help="seconds of sampling")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    logs = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    prefill, decode = procs.start_fake("fake_prefill", logs, args.chunks), procs.start_fake("fake_decode", logs,
                                                                                           args.chunks)
    router = None
    try:
        for fake in (prefill, decode):
            procs.wait_ready(fake, lambda f=fake: procs.request(f.port, "GET", "/health")[0] == 200, 30)
        router = procs.start_ours(logs, prefill, decode)
        procs.wait_ready(router, lambda: procs.generate_ok(router.port), 60)
        stream = args.mode == "stream"
        body = loadgen.body_for(stream, args.chunks)
        loadgen.run(router.url, "/generate", body, stream, args.concurrency, 1)  # warm-up
        load: dict = {}
        thread = threading.Thread(target=lambda: load.update(loadgen.summarize(loadgen.run(
            router.url, "/generate", body, stream, args.concurrency, args.duration + 2), stream)))
        thread.start()
        raw = logs / "py-spy.raw"
        subprocess.run([py_spy, "record", "--pid", str(router.popen.pid), "--duration", str(args.duration),
                        "--rate", str(args.rate), "--format", "raw", "--output", str(raw), "--nonblocking"],
                       check=True, capture_output=True)
        upstream = upstream_connections(router, (prefill.port, decode.port))  # load still on for ~2 s
        thread.join()
    finally:
        for proc in (router, decode, prefill):
            if proc is not None:
                proc.stop()
    result = {"target": "our router (python -m router)", "concurrency": args.concurrency, "mode": args.mode,
              "load_during_sampling": load, "router_connections_to_workers_under_load": upstream, "profile": summarize(raw), "raw_profile": str(raw)}
    out = args.out or RESULTS / f"profile_router_c{args.concurrency}_{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load: {load.get('req_per_s')} req/s, p50 {load.get('latency_ms', {}).get('p50')} ms; "
          f"router connections to the workers: {upstream}")
    for name, share in result["profile"]["by_category_pct"].items():
        print(f"{share:5.1f}%  {name}")
    print(f"profile_router: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
