"""A real PostgreSQL for the store's tests (tests/unit/conftest.py) and its benchmark (bench/store/), started and
stopped by them: Debian's server (`make setup` installs the `postgresql` package) in a cluster made by initdb in a temp
dir, reachable only through a unix socket in that dir (no port to collide on, with another run or the machine's own
server). Durability is off for the tests (their data is thrown away) and at PostgreSQL's defaults for the benchmark
(`durable`: a commit waits for its WAL flush, as a production server's does).

The server is this process's own child (not daemonized by pg_ctl), so that stopping it is a signal and a wait, and
nothing outlives the suite. PostgreSQL refuses to run as root: as root, it runs as the `postgres` user in a dir it
owns."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

BIN_DIRS = Path("/usr/lib/postgresql")
USER = "postgres"  # the superuser initdb makes; trusted on the socket, which only this dir's owner can reach
FAST_AND_THROWAWAY = ["-c", "fsync=off", "-c", "full_page_writes=off", "-c", "synchronous_commit=off"]
READY_TIMEOUT = 30.0


def server_bin() -> Path:
    """The newest installed major version's bin dir; AssertionError naming the fix when there is none."""
    versions = sorted((p for p in BIN_DIRS.glob("*/bin") if (p / "postgres").is_file()),
                      key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    assert versions, f"no PostgreSQL server under {BIN_DIRS}: `make setup` installs Debian's postgresql"
    return versions[-1]


class PostgresServer:
    def __init__(self, durable: bool = False) -> None:
        self.bin = server_bin()
        self.settings = [] if durable else FAST_AND_THROWAWAY
        self.root = Path(tempfile.mkdtemp(prefix="pdcluster-store-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        # as root: the commands run as the postgres user (setuid in the child, so the server stays our child)
        self.as_owner: dict = {}
        if os.geteuid() == 0:
            shutil.chown(self.root, USER, USER)
            self.as_owner = {"user": USER, "group": USER, "extra_groups": []}
        self.process: subprocess.Popen | None = None
        self.databases = 0

    def start(self) -> None:
        """initdb, then the server, waiting until it accepts connections; RuntimeError with its log otherwise."""
        done = subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "-A", "trust", "-E", "UTF8",
                               "--locale=C", "--no-sync", "--no-instructions"],
                              capture_output=True, text=True, check=False, timeout=60, cwd=self.root, **self.as_owner)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), "-k", str(self.root), "-c", "listen_addresses=",
                 *self.settings], stdout=log, stderr=subprocess.STDOUT, cwd=self.root, **self.as_owner)
        self._wait_ready()

    def stop(self) -> None:
        """Stops the server (fast shutdown: open connections are closed) and deletes its dir; safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def url(self, database: str = USER) -> str:
        """The store's URL for a database of this server (SQLAlchemy with psycopg, over the socket)."""
        return f"postgresql+psycopg://{USER}@/{database}?host={self.root}"

    def new_database(self) -> str:
        """A fresh, empty database's URL: each test starts from nothing."""
        self.databases += 1
        name = f"store_{self.databases}"
        with psycopg.connect(host=str(self.root), user=USER, dbname=USER, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited ({self.process.returncode}): {self.log.read_text()[-2000:]}")
            try:
                psycopg.connect(host=str(self.root), user=USER, dbname=USER, connect_timeout=2).close()
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"postgres not ready after {READY_TIMEOUT:.0f}s: {exc}") from exc
            time.sleep(0.05)
