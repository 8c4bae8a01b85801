"""Run SGLang as a child, forward stop signals to it, and leave no process of it behind.

SGLang's launch_server spawns a scheduler and a detokenizer (and more with TP/DP). The child is started in a session
of its own, so the whole tree shares one process group that can be killed in one call once the main process is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from pdcluster.common.children import die_with_parent, exit_status

# What a worker's grace period keeps for itself after SGLang's drain: SGLang's own teardown (it waits up to 5 s between
# looks at its queue) and deregistering from the bootstrap service.
STOP_MARGIN = 10.0
METRICS_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"


def metrics_dir(cmd: list[str], env: dict[str, str] | None) -> tempfile.TemporaryDirectory | None:
    """A fresh directory for SGLang's multiprocess metrics, when it serves /metrics and the caller set none.
    SGLang sets PROMETHEUS_MULTIPROC_DIR itself, but only after its plugins loaded, and prometheus_client reads it
    once, at its first import: pdcluster's CPU plugins import SGLang modules that import it (Mooncake's connector),
    so SGLang's HTTP process kept its TTFT, ITL and request series in a registry its /metrics never reads. Fresh per
    start: files a previous SGLang left would be counted again."""
    serves_metrics = any(arg.split("=")[0] == "--enable-metrics" for arg in cmd)
    if not serves_metrics or METRICS_DIR_VAR in (os.environ if env is None else env):
        return None
    return tempfile.TemporaryDirectory(prefix="pdcluster-sglang-metrics-")


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class Supervisor:
    """`grace_period`: seconds from the stop signal to the end; SGLang drains for all but STOP_MARGIN of it.
    `on_stop`: called at the first stop signal, before SGLang hears of it (the registrar deregisters the worker, so
    the routers send it nothing new while SGLang drains)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None, grace_period: float = 60.0,
                 on_stop: Callable[[], None] = lambda: None,
                 on_restart: Callable[[subprocess.Popen[bytes]], None] = lambda proc: None):
        self.cmd = cmd
        self.env = env
        self.drain_seconds = max(5.0, grace_period - STOP_MARGIN)
        self.on_stop, self.on_restart = on_stop, on_restart
        self.proc: subprocess.Popen[bytes] | None = None
        self._stop_requested_at: float | None = None
        self._restart = threading.Event()
        # Set by a role flip while SGLang may be half-switched (pdcluster/worker/role_flip.py): SGLang exiting then
        # is the flip's to restore, not the worker's end.
        self.mid_flip = threading.Event()

    def restart(self) -> None:
        """Kill SGLang's whole group and start it again with the same command (a role flip that failed half-way: back
        in its old role, pdcluster/worker/role_flip.py). Returns at once; `on_restart` gets the new process."""
        self._restart.set()
        if self.proc is not None:
            kill_group(self.proc.pid, signal.SIGKILL)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.proc is None:
            sys.exit(128 + signum)
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
            self.on_stop()
            # SIGTERM to SGLang's main process only: it shuts its own children down (a child SIGTERMed first would
            # look like a crash to it). The group kill after it exits is the backstop.
            os.kill(self.proc.pid, signal.SIGTERM)
        else:
            kill_group(self.proc.pid, signal.SIGKILL)

    def run(self, while_running: Callable[[subprocess.Popen[bytes]], None] | None = None) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        # If the launcher itself is SIGKILLed, the kernel sends SIGKILL to SGLang's main process; its group is then
        # orphaned but loses its parent, and SGLang's own children watch their parent and exit.
        proc, metrics = self._spawn()
        if while_running is not None:
            while_running(proc)
        try:
            while True:
                returncode = self._wait(proc)
                # SGLang 0.5.23's scheduler crashes right after answering a switch that failed half-way, often before
                # the flip has asked for the restart: wait for the flip's word (a restart, or the flip over).
                while self.mid_flip.is_set() and not self._restart.is_set() and self._stop_requested_at is None:
                    self._restart.wait(0.1)
                if not self._restart.is_set() or self._stop_requested_at is not None:
                    break
                self._restart.clear()
                kill_group(proc.pid, signal.SIGKILL)
                if metrics is not None:
                    metrics.cleanup()
                proc, metrics = self._spawn()
                self.on_restart(proc)
        finally:
            # The main process is gone; whatever is left of its group (scheduler, detokenizer) goes with it.
            kill_group(proc.pid, signal.SIGKILL)
            if metrics is not None:
                metrics.cleanup()
        return exit_status(returncode)

    def _spawn(self) -> tuple[subprocess.Popen[bytes], tempfile.TemporaryDirectory | None]:
        metrics = metrics_dir(self.cmd, self.env)
        env = self.env if metrics is None else {**(self.env or os.environ), METRICS_DIR_VAR: metrics.name}
        self.proc = subprocess.Popen(self.cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)
        return self.proc, metrics

    def _wait(self, proc: subprocess.Popen[bytes]) -> int:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if self._stop_requested_at and time.monotonic() - self._stop_requested_at > self.drain_seconds:
                    kill_group(proc.pid, signal.SIGKILL)
