"""The whole cluster on one machine: bootstrap service, N prefills, M decodes and the router as child processes.

`make up` runs it; the end-to-end tests drive the same class. Every component is started through its public entry
point (`python -m bootstrap`, `python prefill.py`, `python decode.py`, `python -m router`), as in docker compose.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parent.parent


class ComponentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: what the component's config says


class WorkerGroupSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: str
    count: int = Field(default=1, ge=0)
    first_port: int = Field(ge=1024, le=65000)
    first_kv_bootstrap_port: int = Field(default=8999, ge=1024, le=65000)


class LocalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bootstrap: ComponentSpec
    router: ComponentSpec
    prefill: WorkerGroupSpec
    decode: WorkerGroupSpec
    log_dir: str = "logs"
    ready_timeout: float = 600.0

    @classmethod
    def load(cls, path: str | Path) -> LocalSpec:
        with open(path, encoding="utf-8") as handle:
            return cls.model_validate(yaml.safe_load(handle))

    def _port(self, component: ComponentSpec, default: int) -> int:
        if component.port:
            return component.port
        with open(REPO / component.config, encoding="utf-8") as handle:
            return int((yaml.safe_load(handle) or {}).get("port", default))

    @property
    def bootstrap_url(self) -> str:
        return f"http://{self.bootstrap.host}:{self._port(self.bootstrap, 8998)}"

    @property
    def router_url(self) -> str:
        return f"http://{self.router.host}:{self._port(self.router, 8000)}"


@dataclass
class Process:
    name: str
    command: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        log.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(self.command)}\n".encode())
        log.flush()
        self.popen = subprocess.Popen(self.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            os.kill(self.popen.pid, sig)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    spec: LocalSpec
    log_dir: Path
    processes: dict[str, Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        s = self.spec
        self._add("bootstrap", [py, "-m", "bootstrap", "--config", s.bootstrap.config, "--host", s.bootstrap.host,
                                "--port", s.bootstrap_url.rsplit(":", 1)[1]])
        cluster = ["--cluster", f"bootstrap_url={s.bootstrap_url}"]
        for i in range(s.prefill.count):
            self._add(f"prefill-{i}", [py, "prefill.py", "--config", s.prefill.config, *cluster,
                                       "--port", str(s.prefill.first_port + i),
                                       "--disaggregation-bootstrap-port", str(s.prefill.first_kv_bootstrap_port + i)])
        for i in range(s.decode.count):
            self._add(f"decode-{i}", [py, "decode.py", "--config", s.decode.config, *cluster,
                                      "--port", str(s.decode.first_port + i)])
        self._add("router", [py, "-m", "router", "--config", s.router.config, "--host", s.router.host,
                             "--port", s.router_url.rsplit(":", 1)[1], "--bootstrap-url", s.bootstrap_url])

    def _add(self, name: str, command: list[str]) -> None:
        self.processes[name] = Process(name, command, self.log_dir / f"{name}.log")

    @property
    def router_url(self) -> str:
        return self.spec.router_url

    def start(self) -> None:
        for process in self.processes.values():
            process.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.spec.ready_timeout)
        while time.monotonic() < deadline:
            dead = [p for p in self.processes.values() if not p.running]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with status {dead[0].popen.returncode} before the "
                                   f"cluster was ready; its log ({dead[0].log_path}) ends with:\n{dead[0].tail()}")
            try:
                ready = httpx.get(f"{self.router_url}/ready", timeout=2)
                healthy = sum(w["healthy"] for w in ready.json()["workers"])
                if ready.status_code == 200 and healthy >= self.spec.prefill.count + self.spec.decode.count:
                    return  # every worker serves, not just the first pair
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"router not ready after {timeout or self.spec.ready_timeout:.0f}s; logs in {self.log_dir}")

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM everything (router first, so no new work reaches workers), then SIGKILL stragglers."""
        order = ["router", *[n for n in self.processes if n not in ("router", "bootstrap")], "bootstrap"]
        for name in order:
            self.processes[name].signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in order:
            process = self.processes[name]
            if process.popen is None:
                continue
            try:
                process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait()
        return {name: p.popen.returncode if p.popen else None for name, p in self.processes.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdcluster.local", description="Run the whole cluster locally.")
    parser.add_argument("--config", default="configs/local.yaml")
    args = parser.parse_args(argv)
    spec = LocalSpec.load(args.config)
    cluster = LocalCluster(spec, REPO / spec.log_dir)
    stopping = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"starting bootstrap, {spec.prefill.count} prefill, {spec.decode.count} decode and the router "
          f"(logs in {cluster.log_dir}) ...", flush=True)
    cluster.start()
    try:
        cluster.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    print(f"ready: the router serves at {cluster.router_url} (POST /generate, /v1/chat/completions); Ctrl-C stops",
          flush=True)
    reported: set[str] = set()
    while not stopping:
        # A dead component is reported, not fatal: the rest of the cluster goes on serving without it.
        for process in cluster.processes.values():
            if not process.running and process.name not in reported:
                reported.add(process.name)
                print(f"{process.name} exited ({process.popen.returncode}); its log ends with:\n{process.tail(10)}",
                      file=sys.stderr, flush=True)
        time.sleep(0.5)
    print("stopping ...", flush=True)
    cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
