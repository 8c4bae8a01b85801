"""One component of the local cluster (pdcluster/local/cluster.py) as a child process: started, signalled, its log kept,
and what its supervisor needs to restart it with backoff (pdcluster/local/restarts.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.local.restarts import Backoff, RestartPolicy

# Signals that mean "stop": a process sent one through Process.signal was asked to go, and is not restarted.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGQUIT})


@dataclass
class Process:
    name: str
    command: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Asked to stop (signalled through signal(), or held): the supervisor leaves it down until start().
    held: bool = False
    restarts: int = 0  # restarts by the supervisor (not by start())
    backoff: Backoff = field(init=False)
    restart_at: float | None = None  # when the supervisor starts it again (time.monotonic)
    exit_seen: bool = False  # the supervisor has dealt with the current popen's exit
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self) -> None:
        self.backoff = Backoff(self.policy)

    def start(self) -> None:
        """Start it (again), and let the supervisor restart it should it exit on its own. A no-op if it runs."""
        with self.lock:
            if not self.running:
                self._spawn()
            self.held, self.restart_at = False, None

    def _spawn(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child gets its own copy; ours is closed below
        log.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(self.command)}\n".encode())
        log.flush()
        self.popen = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        log.close()  # the child has its own copy
        self.exit_seen = False
        self.backoff.started()

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the component's launcher; a stop signal also tells the supervisor to leave it down."""
        if sig in STOP_SIGNALS:
            self.held = True
        if self.popen is not None and self.running:
            os.kill(self.popen.pid, sig)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
