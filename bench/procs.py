"""Start, watch and stop the processes a benchmark needs: the fake workers and the two routers under test.

Every process is started here and stopped here by its own PID (and that PID's children): nothing is killed by
name, so other work on the machine is left alone.
"""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
BOOTSTRAP_PORT = 8999  # a prefill's KV bootstrap port, only passed along: nothing listens there


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


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
        """CPU time (user + system, all threads) used so far by the process and its live children."""
        total = 0.0
        try:
            proc = psutil.Process(self.popen.pid)
            for p in [proc, *proc.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        return total

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        try:
            children = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def start(name: str, argv: list[str], log_dir: Path, port: int, env: dict[str, str] | None = None) -> Proc:
    log = log_dir / f"{name}.log"
    handle = open(log, "wb")
    popen = subprocess.Popen(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})})
    handle.close()
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
    return start(name, [sys.executable, "-m", "bench.fake_worker", "--port", str(port), "--chunks", str(chunks)],
                 log_dir, port)


def start_ours(log_dir: Path, prefill: Proc, decode: Proc, log_level: str = "warning", workers: int = 1) -> Proc:
    port = free_port()
    config = log_dir / "router.yaml"
    config.write_text(
        "# written by bench.procs: our router, static workers (the fakes), no bootstrap service\n"
        f"host: {HOST}\nport: {port}\nbootstrap_url: null\n"
        f"prefill: [{{url: \"{prefill.url}\", kv_bootstrap_port: {BOOTSTRAP_PORT}}}]\n"
        f"decode: [{{url: \"{decode.url}\"}}]\n"
        f"prefill_policy: round_robin\ndecode_policy: round_robin\nlog_level: {log_level}\nworkers: {workers}\n")
    return start("router_ours", [sys.executable, "-m", "router", "--config", str(config)], log_dir, port)


def start_sglang(log_dir: Path, prefill: Proc, decode: Proc, bootstrap_port: int = BOOTSTRAP_PORT) -> Proc:
    """SGLang's Rust router in PD mode over one prefill (with its KV bootstrap port) and one decode."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url,
            "--host", HOST, "--port", str(port), "--policy", "round_robin",
            "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
            "--log-level", "warn", "--shutdown-grace-period-secs", "1"]
    # HF_HUB_OFFLINE: belt and braces; the fakes report no model path, so it has no tokenizer to fetch anyway.
    return start("router_sglang", argv, log_dir, port, env={"HF_HUB_OFFLINE": "1", "RUST_LOG_STYLE": "never"})


def fake_generate_count(proc: Proc) -> int:
    import json

    status, body = request(proc.port, "GET", "/fake_stats")
    return json.loads(body)["paths"].get("/generate", 0) if status == 200 else -1
