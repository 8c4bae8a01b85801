"""The whole cluster on one machine: bootstrap service, N prefills, M decodes and the router as child processes.

`make up` runs it; the end-to-end tests drive the same class. Every component is started through its public entry
point (`python -m bootstrap`, `python -m prefill`, `python -m decode`, `python -m router`, and with a `planner` in
the spec `python -m planner`), which a checkout and an installed wheel both have. Relative paths (the spec's configs
and log_dir, the model paths in the workers' configs) are relative to the directory the cluster is started from, as
for each component's own command.

Once the cluster is ready, `supervise()` starts a thread that restarts any component that exits without being asked
to, with the backoff of pdcluster/local/restarts.py (1 s, doubling, capped at 30 s; a crash loop is reported and held at
the cap). A component is "asked to" stop when it is signalled through `Process.signal` (SIGTERM/SIGINT/SIGKILL) or
`LocalCluster.hold`; it then stays down until `start()`. A restarted worker registers again and the router takes it
back on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdcluster.common.config_file import ConfigError, fail, load_model
from pdcluster.common.stopping import stop_requested
from pdcluster.local.models import model_args
from pdcluster.local.process import Process
from pdcluster.local.restarts import RestartPolicy
from pdcluster.local.spec import ComponentSpec, LocalSpec


@dataclass(eq=False)  # hashable: supervising clusters are kept in a WeakSet
class LocalCluster:
    spec: LocalSpec
    log_dir: Path
    processes: dict[str, Process] = field(default_factory=dict)
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Where the supervisor's lines go (one line per event; the text says what happened).
    report: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True), repr=False)

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        py = sys.executable
        s = self.spec
        self._add("bootstrap", [py, "-m", "bootstrap", "--config", s.bootstrap.config, "--host", s.bootstrap.host,
                                "--port", s.bootstrap_url.rsplit(":", 1)[1]])
        cluster = ["--cluster", f"bootstrap_url={s.bootstrap_url}"]
        for i in range(s.prefill.count):
            self._add(f"prefill-{i}", [py, "-m", "prefill", "--config", s.prefill.config, *s.prefill.args, *cluster,
                                       "--port", str(s.prefill.first_port + i),
                                       "--disaggregation-bootstrap-port", str(s.prefill.first_kv_bootstrap_port + i),
                                       "--cluster", f"kv_events_port_base={s.prefill.first_kv_events_port + 2 * i}"])
        for i in range(s.decode.count):
            # A switch-enabled decode runs a KV bootstrap server and KV events too: the ports after the prefills',
            # so that workers starting together never pick the same one.
            j = s.prefill.count + i
            self._add(f"decode-{i}", [py, "-m", "decode", "--config", s.decode.config, *s.decode.args, *cluster,
                                      "--port", str(s.decode.first_port + i),
                                      "--cluster", f"kv_bootstrap_port_base={s.prefill.first_kv_bootstrap_port + j}",
                                      "--cluster", f"kv_events_port_base={s.prefill.first_kv_events_port + 2 * j}"])
        self._add("router", [py, "-m", "router", "--config", s.router.config, "--host", s.router.host,
                             "--port", s.router_url.rsplit(":", 1)[1], "--bootstrap-url", s.bootstrap_url])
        if s.planner is not None:
            self._add("planner", [py, "-m", "planner", "--config", s.planner.config, "--host", s.planner.host,
                                  *(["--port", str(s.planner.port)] if s.planner.port else []),
                                  "--router-url", s.router_url, "--bootstrap-url", s.bootstrap_url])

    def _add(self, name: str, command: list[str]) -> None:
        self.processes[name] = Process(name, command, self.log_dir / f"{name}.log", policy=self.policy)

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
                first = dead[0]
                status = first.popen.returncode if first.popen is not None else "none (never started)"
                raise RuntimeError(f"{first.name} exited with status {status} before the "
                                   f"cluster was ready; its log ({first.log_path}) ends with:\n{first.tail()}")
            try:
                ready = httpx.get(f"{self.router_url}/ready", timeout=2)
                healthy = sum(w["healthy"] for w in ready.json()["workers"])
                if ready.status_code == 200 and healthy >= self.spec.prefill.count + self.spec.decode.count:
                    return  # every worker serves, not just the first pair
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"router not ready after {timeout or self.spec.ready_timeout:.0f}s; logs in {self.log_dir}")

    # ----- supervision -----

    def supervise(self, interval: float = 0.2) -> None:
        """Restart, from now on, any component that exits without being asked to (a thread; idempotent)."""
        if self._supervisor is None or not self._supervisor.is_alive():
            self._stopping.clear()
            self._supervisor = threading.Thread(target=self._supervise, args=(interval,), name="local-supervisor",
                                                daemon=True)
            self._supervisor.start()
            _SUPERVISED.add(self)

    @property
    def supervising(self) -> bool:
        return self._supervisor is not None and self._supervisor.is_alive()

    def hold(self, name: str) -> None:
        """`name` is about to be stopped on purpose: leave it down until start() (or release())."""
        self.processes[name].held = True

    def release(self, name: str) -> None:
        """Let the supervisor restart `name` again (at once if it is down)."""
        process = self.processes[name]
        with process.lock:
            process.held, process.restart_at = False, None
            process.exit_seen = not process.running and process.popen is not None
            if process.exit_seen:
                process.restart_at = time.monotonic()

    @contextlib.contextmanager
    def held(self, name: str) -> Iterator[Process]:
        """Stop and start `name` by hand inside the block without the supervisor racing you."""
        self.hold(name)
        try:
            yield self.processes[name]
        finally:
            if not self.processes[name].running and self.processes[name].held:
                self.release(name)
            else:
                self.processes[name].held = False

    def restarts(self) -> dict[str, int]:
        return {name: p.restarts for name, p in self.processes.items()}

    def _supervise(self, interval: float) -> None:
        while not self._stopping.wait(interval):
            for process in self.processes.values():
                try:
                    self._check(process)
                except Exception as exc:  # the supervisor must outlive any one failure
                    self.report(f"supervisor: could not restart {process.name}: {type(exc).__name__}: {exc}")

    def _check(self, process: Process) -> None:
        with process.lock:
            if process.popen is None or process.held or process.running or self._stopping.is_set():
                return
            now = time.monotonic()
            if not process.exit_seen:
                process.exit_seen = True
                decision = process.backoff.exited()
                process.restart_at = now + decision.delay
                status = process.popen.returncode
                what = f"signal {-status}" if status < 0 else f"status {status}"
                line = (f"{process.name} exited ({what}) after {decision.ran:.0f}s, not asked to; restart "
                        f"#{decision.restart} in {decision.delay:.0f}s")
                if decision.crash_loop:
                    line = (f"CRASH LOOP: {process.name} exited {decision.exits_in_window} times within "
                            f"{self.policy.loop_window:.0f}s; restarting it every {self.policy.cap:.0f}s until it "
                            f"stays up {self.policy.stable_after:.0f}s. " + line)
                if decision.loop_started or not decision.crash_loop:
                    line += f"; its log ({process.log_path}) ends with:\n{process.tail(10)}"
                self.report(line)
            elif process.restart_at is None or now >= process.restart_at:
                process._spawn()
                process.restarts += 1
                process.restart_at = None
                self.report(f"{process.name} restarted (restart #{process.restarts}, pid {process.popen.pid})")

    # ----- stop -----

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM everything (router first, so no new work reaches workers), then SIGKILL stragglers."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        order = [n for n in ("router", *[n for n in self.processes if n not in ("router", "bootstrap")], "bootstrap")
                 if n in self.processes]
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


# Clusters supervising in this Python process, for hold_pid().
_SUPERVISED: weakref.WeakSet[LocalCluster] = weakref.WeakSet()


def hold_pid(pid: int) -> str | None:
    """A caller about to kill the launcher with this pid on purpose (e.g. a test helper that kills process trees)
    says so here: a supervising cluster then leaves that component down until start(). Returns its name."""
    for cluster in list(_SUPERVISED):
        for process in cluster.processes.values():
            if process.popen is not None and process.popen.pid == pid:
                process.held = True
                return process.name
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdcluster.local", description="Run the whole cluster locally.")
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--planner", metavar="CONFIG", help="start the SLO planner too, with this config (e.g. "
                                                            "configs/planner.yaml)")
    parser.add_argument("--model", help="serve this model instead of the worker configs' (a local Hugging Face "
                                        "checkpoint, e.g. models/tiny-llama, or a hub id on a connected machine)")
    args = parser.parse_args(argv)
    spec = load_model(LocalSpec, args.config, {}, prog="pdcluster.local")
    if args.planner:
        spec.planner = ComponentSpec(config=args.planner)
    if args.model:
        for group in (spec.prefill, spec.decode):
            group.args += model_args(args.model)
    try:
        cluster = LocalCluster(spec, Path(spec.log_dir).resolve())
    except ConfigError as exc:  # a component's config file, read for its port
        fail("pdcluster.local", str(exc))
    stopping = stop_requested()
    print(f"starting bootstrap, {spec.prefill.count} prefill, {spec.decode.count} decode, the router"
          f"{' and the planner' if spec.planner else ''} "
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
    # A component that exits on its own is restarted with backoff (pdcluster/local/restarts.py), each time with a line
    # on stderr; the rest of the cluster goes on serving meanwhile.
    cluster.supervise()
    while not stopping():
        time.sleep(0.5)
    print("stopping ...", flush=True)
    cluster.stop()
    return 0
