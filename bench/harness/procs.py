"""Start, watch and stop the processes a benchmark needs: the fake workers, the routers under test, any process
tree's CPU time; bench/'s one set of process and port helpers.

Every process is started here and stopped here by its own PID (and that PID's children): nothing is killed by
name, so other work on the machine is left alone.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from bench.harness.paths import REPO

HOST = "127.0.0.1"
BOOTSTRAP_PORT = 8999  # the fake prefill's KV bootstrap port (as_workers), only passed along: nothing listens


def free_port(host: str = HOST) -> int:
    """A port the OS reports free on `host` now. The tree's one copy: the tests import it too (tests/helpers.py)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tree(pid: int) -> list[psutil.Process]:
    """The process and its live descendants (empty once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) used so far by the process and its live descendants."""
    total = 0.0
    for p in tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@dataclass
class Worker:
    """A worker as the routers under test are given it: its URL, and a prefill's KV bootstrap port."""
    name: str
    url: str
    kv_bootstrap_port: int | None = None
    forward_tokens: int | None = None  # a prefill's chunked prefill size, for our router's liveness


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    port: int

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.popen.pid)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        children = tree(self.popen.pid)[1:]
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def start(name: str, argv: list[str], log_dir: Path, port: int, env: dict[str, str] | None = None) -> Proc:
    log = log_dir / f"{name}.log"
    with open(log, "wb") as handle:  # the child has its own copy
        popen = subprocess.Popen(argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {})})
    return Proc(name, popen, log, port)


def request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_ready(proc: Proc, check, timeout: float) -> float:
    """Poll `check()` until it returns True; return the seconds it took. Fails if the process dies or time is up."""
    started = time.monotonic()
    while True:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; see {proc.log}")
        try:
            if check():
                return time.monotonic() - started
        except OSError:
            pass
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{proc.name} not ready after {timeout:.0f} s; see {proc.log}")
        time.sleep(0.1)


def generate_ok(port: int) -> bool:
    status, _ = request(port, "POST", "/generate", b'{"text": "ready?", "sampling_params": {"max_new_tokens": 1}}')
    return status == 200


def start_fake(name: str, log_dir: Path, chunks: int) -> Proc:
    port = free_port()
    return start(name, [sys.executable, "-m", "bench.harness.fake_worker", "--port", str(port), "--chunks",
                        str(chunks)], log_dir, port)


def start_fakes(log_dir: Path, chunks: int, names: tuple[str, ...] = ("fake_prefill", "fake_decode")) -> list[Proc]:
    """Fake workers (bench/harness/fake_worker.py) of these names, each answering /health; if one does not, those
    started are stopped again."""
    fakes: list[Proc] = []
    try:
        for name in names:
            fakes.append(start_fake(name, log_dir, chunks))
        for fake in fakes:
            wait_ready(fake, lambda f=fake: request(f.port, "GET", "/health")[0] == 200, 30)
    except BaseException:
        for fake in fakes:
            fake.stop()
        raise
    return fakes


def as_workers(prefill: Proc, decode: Proc) -> tuple[Worker, Worker]:
    """A fake prefill and decode as the routers under test are given them. The fake prefill's KV bootstrap port is
    only passed along by the routers: nothing listens there."""
    return Worker(prefill.name, prefill.url, BOOTSTRAP_PORT), Worker(decode.name, decode.url)


def start_ours(name: str, log_dir: Path, prefills: list[Worker], decodes: list[Worker], policy: str = "round_robin",
               log_level: str = "warning", workers: int = 1, settings: dict | None = None,
               env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()) -> Proc:
    """Our router over a static list of workers (no bootstrap service: it must not discover any other worker). One
    process by default: next to real SGLang workers on 2 cores, they need the other core. `settings`: more of its
    config's keys; `wrapper`: the command it runs under (bench.tracing.instructions: valgrind)."""
    port = free_port()
    config = {"host": HOST, "port": port, "bootstrap_url": None,
              "prefill": [{"url": w.url, "kv_bootstrap_port": w.kv_bootstrap_port,
                           **({"forward_tokens": w.forward_tokens} if w.forward_tokens else {})} for w in prefills],
              "decode": [{"url": w.url} for w in decodes],
              "prefill_policy": policy, "decode_policy": "round_robin", "log_level": log_level, "workers": workers,
              **(settings or {})}
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return start(name, [*wrapper, sys.executable, "-m", "router", "--config", str(path)], log_dir, port, env)


def start_sglang(log_dir: Path, prefill: Worker | list[Worker], decode: Worker, policy: str = "round_robin",
                 name: str = "router_sglang", extra: tuple[str, ...] = ()) -> Proc:
    """SGLang's Rust router in PD mode over prefills (each with its KV bootstrap port) and one decode; `policy` for
    its prefills (its decodes: round robin); `extra`: more of its options (bench.overload: its rate limiter)."""
    port = free_port()
    prefills = prefill if isinstance(prefill, list) else [prefill]
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            *[arg for p in prefills for arg in ("--prefill", p.url, str(p.kv_bootstrap_port))], "--decode", decode.url,
            "--host", HOST, "--port", str(port), "--prefill-policy", policy, "--decode-policy", "round_robin",
            "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
            "--log-level", "warn", "--shutdown-grace-period-secs", "1",
            # A busy CPU prefill's /health waits for its scheduler (a forward pass of seconds): at its default 5 s,
            # SGLang's router took both prefills for dead under long prompts and refused requests (503s).
            "--health-check-timeout-secs", "60", *extra]
    # HF_HUB_OFFLINE: belt and braces; it is given no model path, so it has no tokenizer to fetch anyway.
    return start(name, argv, log_dir, port, env={"HF_HUB_OFFLINE": "1", "RUST_LOG_STYLE": "never"})


def fake_generate_count(proc: Proc) -> int:
    import json

    status, body = request(proc.port, "GET", "/fake_stats")
    return json.loads(body)["paths"].get("/generate", 0) if status == 200 else -1
