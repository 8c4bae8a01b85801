"""The compose tests' fixtures: a Docker engine, the cpu image built as docker-compose.yml defines it, one project.

Everything comes up once for tests/compose, in this order, and is torn down after its last test even when a test
fails (package scope: gone before tests/e2e starts its own cluster in the same run; the order is tests/conftest.py's):
  1. the engine (tests/compose/engine.py: the running one, else our dockerd, stopped by its PID at the end);
  2. the base image (present, pulled, or made with debootstrap) and the image, built with `docker build` from what
     `docker compose --profile cpu config` says (Compose v5 builds only through the buildx plugin, absent here);
  3. one compose project with a unique name, `up --wait` on the cpu profile, the router published on a free port of
     127.0.0.1 (the tests reach the cluster only through it), with the router config made to name the pair that
     served each answer (expose_worker_ids), which the scaling tests read.
Any step that cannot work fails every test (an error at setup): nothing here skips, so a broken compose cannot pass.
Logs (dockerd, build, every container) and timings are in logs/compose-tests/; the containers' logs also in pytest's
tmp dir (compose-logs*), which outlives a CI clone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.compose.base_image import dockerfile_bases, ensure_image
from tests.compose.engine import Engine, EngineError, start_engine
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
RUN_DIR = REPO / "logs" / "compose-tests"
PROJECT_PREFIX = "pdcluster-test-"
PROFILE = "cpu"
UP_TIMEOUT = 900        # seconds for the workers to serve: SGLang starts in ~30-60 s per worker on 2 cores
# The workers' KV pool here: SmolLM2's context (8192) plus a decode's reserve (512) and a page (64), instead of the
# CPU profile's 16384. Each SmolLM2 worker holds its pool and a HiCache host pool twice its size (45 KiB a token): at
# 16384, 2 prefills and 2 decodes took ~16 GiB of this 24 GiB machine (measured: ~1 GiB left free while the crash
# test's decode restarted), and a restarting worker whose host pool and SGLang's 1 GiB reserve are not free exits
# ("Not enough host memory available") and is restarted again: CI once failed so. What the tests check (scaling,
# restarts, volumes, exact tokens) does not depend on the pool's size.
TEST_KV_POOL = 8192 + 512 + 64
MAX_RESTARTS = 3        # a worker restarted this often while we wait for it is failing, not starting
BUILD_TIMEOUT = 3600
TIMINGS: dict[str, float | str] = {}


def _fail(message: str) -> None:
    pytest.fail(message, pytrace=False)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _remove_stale_projects(eng) -> None:
    """Containers and networks of test projects (pdcluster-test-*) an earlier, killed run left in our data root."""
    ids = eng.docker("ps", "-aq", "--filter", "label=com.docker.compose.project", "--format",
                     '{{.ID}} {{.Label "com.docker.compose.project"}}', check=False).stdout.decode().split("\n")
    stale = [line.split()[0] for line in ids if len(line.split()) == 2 and line.split()[1].startswith(PROJECT_PREFIX)]
    if stale:
        print(f"[compose] removing {len(stale)} containers left by an earlier run", file=sys.stderr)
        eng.docker("rm", "-f", "-v", *stale, check=False, timeout=300)
    eng.docker("network", "prune", "--force", "--filter", "label=com.docker.compose.project", check=False)
    volumes = eng.docker("volume", "ls", "-q", "--filter", "label=com.docker.compose.project",
                         check=False).stdout.decode().split()
    if stale_volumes := [v for v in volumes if v.startswith(PROJECT_PREFIX)]:
        eng.docker("volume", "rm", "-f", *stale_volumes, check=False)


@pytest.fixture(scope="package")
def engine():
    if RUN_DIR.exists():
        shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    # CI's time limit or a `kill` ends pytest with SIGTERM: turn it into KeyboardInterrupt so that teardown runs.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        started = time.monotonic()
        eng = start_engine(RUN_DIR)
    except (EngineError, OSError, subprocess.TimeoutExpired) as exc:
        _fail(f"no Docker engine for the compose tests: {exc}")
    if eng.pid is not None:  # our daemon: a killed run's projects come back with it (restart policies); end them
        _remove_stale_projects(eng)
        shutil.rmtree(RUN_DIR / "router.yaml", ignore_errors=True)  # a bind source such a container made a folder
    TIMINGS["engine"] = "started for this run" if eng.pid else f"already running at {eng.host}"
    TIMINGS["engine_start_s"] = round(time.monotonic() - started, 1)
    try:
        yield eng
    finally:
        eng.stop()


@dataclass
class Project:
    engine: Engine
    name: str
    files: list[Path]
    env: dict[str, str]
    port: int
    keep_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = [self.engine.cli, "compose", "--project-name", self.name, "--project-directory", str(REPO),
                *(f for path in self.files for f in ("-f", str(path))), "--profile", PROFILE, *args]
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if check and proc.returncode != 0:
            _fail(f"docker compose {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}\n"
                  f"{proc.stdout[-2000:]}"
                  f"\n(container logs: {RUN_DIR / 'compose.log'})")
        return proc

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return self.engine.docker(*args, timeout=timeout, check=check)

    def containers(self, service: str | None = None, all: bool = False) -> list[str]:
        """Container ids of the project (of one service), running ones unless `all`."""
        filters = ["--filter", f"label=com.docker.compose.project={self.name}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = self.docker("ps", "-q", "--no-trunc", *(["-a"] if all else []), *filters).stdout.decode()
        return out.split()

    def inspect(self, container: str) -> dict:
        return json.loads(self.docker("inspect", container).stdout)[0]

    def save_logs(self, suffix: str = "") -> Path:
        proc = self.compose("logs", "--no-color", "--timestamps", check=False, timeout=120)
        path = RUN_DIR / f"compose{suffix}.log"
        path.write_text(proc.stdout + proc.stderr)
        if self.keep_dir is not None:  # CI deletes its clone (and logs/ with it); pytest's tmp dirs stay
            self.keep_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, self.keep_dir / path.name)
        return path

    def why_restarted(self, container: str) -> str:
        """A restarted container's last exit and the end of its log, for a failure message that CI prints."""
        info = self.inspect(container)
        state = {k: info["State"].get(k) for k in ("Status", "ExitCode", "OOMKilled", "Error", "FinishedAt")}
        tail = self.docker("logs", "--tail", "40", container, check=False)
        log = (tail.stdout + tail.stderr).decode(errors="replace")
        return f"{info['Name']}: restarted {info['RestartCount']} times, last exit {state}; its log ends:\n{log}"

    def ready_listing(self) -> tuple[int, list[dict]]:
        """The router's /ready: its status and the workers it lists (0, [] when it does not answer)."""
        try:
            response = httpx.get(f"{self.url}/ready", timeout=10)
            return response.status_code, response.json().get("workers", [])
        except (httpx.HTTPError, ValueError):
            return 0, []

    def up(self, *args: str) -> None:
        """`docker compose up --detach` (with args, e.g. --scale), then until the router serves with the workers the
        project has. Not `--wait`: that fails as soon as a container exits once, and a worker may exit at start and be
        restarted by its policy (SGLang's start-up memory checks race with other processes starting); a worker that
        keeps failing (MAX_RESTARTS) fails the test at once, with its log."""
        self.compose("up", "--detach", "--no-build", *args, timeout=600)
        want = {role: len(self.containers(f"{role}-{PROFILE}")) for role in ("prefill", "decode")}
        self.wait_for_workers(want["prefill"], want["decode"])

    def wait_for_workers(self, prefills: int, decodes: int, timeout: float = UP_TIMEOUT) -> list[dict]:
        """Until /ready is 200 listing exactly this many prefills and decodes, each one serving (see serving())."""
        deadline, status, listing = time.monotonic() + timeout, 0, []
        # Restarts are counted from here: one a test caused (a killed worker) is not a failing start.
        restarts_before = {c: self.inspect(c)["RestartCount"] for c in self.containers(all=True)}
        while time.monotonic() < deadline:
            status, listing = self.ready_listing()
            if (status == 200 and len(serving(listing, "prefill")) == prefills
                    and len(serving(listing, "decode")) == decodes and len(listing) == prefills + decodes):
                return listing
            for container in self.containers(all=True):
                if self.inspect(container)["RestartCount"] - restarts_before.get(container, 0) >= MAX_RESTARTS:
                    _fail(f"{self.why_restarted(container)}\nall logs: {self.save_logs('-failed')}")
            time.sleep(1)
        _fail(f"after {timeout:.0f} s: /ready {status}, workers {json.dumps(listing, indent=1)}; wanted {prefills} "
              f"prefill(s) and {decodes} decode(s) serving; logs: {self.save_logs('-failed')}")


def serving(listing: list[dict], role: str) -> list[dict]:
    """Workers of `role` the router sends requests to: admitted, healthy, compatible, and their breaker closed (after
    a failure it opens, and closes after its cooldown on a successful probe): the router's own `unusable`."""
    return [w for w in listing
            if w["role"] == role and not w["unusable"] and not w["incompatible"] and w["breaker"] == "closed"]


def compose_env(port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        COMPOSE_PROFILES=PROFILE,            # beats .env's gpu
        PDCLUSTER_PUBLISH_ADDR="127.0.0.1",
        PDCLUSTER_PUBLISH_PORT=str(port),
        COMPOSE_PROGRESS="plain",
        COMPOSE_ANSI="never",
    )
    # The build trusts what this host trusts: behind a TLS-intercepting proxy that is what makes pip work in the
    # build (PDCLUSTER_EXTRA_CA set by the caller wins).
    host_bundle = os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    if not env.get("PDCLUSTER_EXTRA_CA") and Path(host_bundle).is_file():
        env["PDCLUSTER_EXTRA_CA"] = host_bundle
    return env


@pytest.fixture(scope="package")
def image(engine) -> dict:
    """Builds every image the cpu profile uses, exactly as `docker compose config` describes it. Returns
    {image: build settings}."""
    env = {**engine.env, **compose_env(0)}
    proc = subprocess.run([engine.cli, "compose", "-f", str(REPO / "docker-compose.yml"), "--profile", PROFILE,
                           "config", "--format", "json"], env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        _fail(f"docker compose config failed: {proc.stderr}")
    config = json.loads(proc.stdout)
    builds = {svc["image"]: svc["build"] for svc in config["services"].values() if "build" in svc}
    if not builds:
        _fail("no service of the cpu profile has a build section")
    for tag, build in builds.items():
        context = Path(build["context"])
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        target = build.get("target")
        for base in dockerfile_bases(dockerfile, target):
            started = time.monotonic()
            try:
                how = ensure_image(engine, base, RUN_DIR)
            except EngineError as exc:
                _fail(f"base image {base}: {exc}")
            TIMINGS[f"base {base}"] = how
            TIMINGS[f"base {base} s"] = round(time.monotonic() - started, 1)
        argv = [engine.cli, "build", "--progress=plain", "-f", str(dockerfile), "-t", tag]
        argv += ["--target", target] if target else []
        for key, value in (build.get("args") or {}).items():
            argv += ["--build-arg", f"{key}={value}"]
        for secret in build.get("secrets") or []:
            source = config["secrets"][secret["source"]]["file"]
            argv += ["--secret", f"id={secret.get('target') or secret['source']},src={source}"]
        argv.append(str(context))
        log = RUN_DIR / f"build-{tag.replace(':', '-').replace('/', '-')}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            out.write(" ".join(argv) + "\n")
            out.flush()
            try:
                code = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=BUILD_TIMEOUT).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        TIMINGS[f"build {tag} s"] = round(time.monotonic() - started, 1)
        if code != 0:
            _fail(f"building {tag} failed ({code}); the end of {log}:\n{log.read_text(errors='replace')[-4000:]}")
        size = engine.docker("image", "inspect", tag, "--format", "{{.Size}}").stdout.decode().strip()
        TIMINGS[f"image {tag} GB"] = round(int(size) / 1e9, 2)
    if engine.pid is not None:  # our own engine (never someone else's): drop what this build replaced, so that the
        # cache dir stays at about one image (~12 GB); the build cache of the current image survives the prune.
        engine.docker("image", "prune", "--force", check=False, timeout=300)
        engine.docker("builder", "prune", "--force", "--keep-storage", "5GB", check=False, timeout=300)
    return builds


def copy_out(engine, tag: str, model: str) -> Path:
    """/app/models/<model> as built in the image, copied to the run's folder."""
    target = RUN_DIR / "image-models" / model
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        container = engine.docker("create", tag).stdout.decode().strip()
        try:
            engine.docker("cp", f"{container}:/app/models/{model}", str(target), timeout=300)
        finally:
            engine.docker("rm", "-f", container, check=False)
    return target


@pytest.fixture(scope="package")
def image_model(engine, image) -> Path:
    """The cpu profile's model (SmolLM2) as built in the image, copied out: the reference runs on it."""
    return copy_out(engine, next(iter(image)), "smollm2-135m-instruct")


@pytest.fixture(scope="package")
def reference(image_model):
    from tests.e2e.reference import ReferenceModel

    return ReferenceModel(str(image_model))


@pytest.fixture(scope="package")
def project(engine, image, tmp_path_factory) -> Project:
    port = free_port()
    name = f"{PROJECT_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
    # The router's compose config plus expose_worker_ids, so that an answer names the pair that served it.
    router_config = yaml.safe_load((REPO / "configs" / "compose" / "router.yaml").read_text())
    router_config["expose_worker_ids"] = True
    # Round robin, not the shipped cache_aware: the checks spread one prompt over both prefills (the new one's warm
    # disk is no hit in a router's KV index).
    router_config["prefill_policy"] = "round_robin"
    (RUN_DIR / "router.yaml").write_text(yaml.safe_dump(router_config))
    override = RUN_DIR / "compose.test.yml"
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    override.write_text(yaml.safe_dump({"services": {
        "router": {"command": ["python", "-m", "router", "--config", "/test/router.yaml"],
                   "volumes": [f"{RUN_DIR / 'router.yaml'}:/test/router.yaml:ro"]},
        # Each worker's command as the compose file has it, with a KV pool of TEST_KV_POOL tokens.
        **{name: {"command": [*services[name]["command"], "--max-total-tokens", str(TEST_KV_POOL)]}
           for name in (f"prefill-{PROFILE}", f"decode-{PROFILE}")},
    }}))
    proj = Project(engine, name, [REPO / "docker-compose.yml", override], {**engine.env, **compose_env(port)}, port,
                   keep_dir=tmp_path_factory.mktemp("compose-logs"))
    TIMINGS["project"] = name
    try:
        started = time.monotonic()
        proj.up()
        TIMINGS["up until serving s"] = round(time.monotonic() - started, 1)
        yield proj
    finally:
        if proj.containers(all=True):
            proj.save_logs()  # test_down saves them before its `down`
        proj.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", check=False, timeout=300)


@pytest.fixture(scope="package")
def router(project):
    with httpx.Client(base_url=project.url, timeout=120) as client:
        yield client


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("compose tests: timings")
        for key, value in TIMINGS.items():
            terminalreporter.write_line(f"{key}: {value}")
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        (RUN_DIR / "timings.json").write_text(json.dumps(TIMINGS, indent=2) + "\n")
