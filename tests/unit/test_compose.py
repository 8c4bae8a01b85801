"""docker-compose.yml and configs/compose/: valid Compose, the promised topology, and every service's command runs.

No Docker engine is needed. The Compose Specification's official JSON schema comes vendored (with its sha256) in the
pinned `check-jsonschema` package of the `test` extra (`make setup` installs it); nothing is downloaded here, and a
missing schema fails the test. The commands run from the repository root, as in the image (WORKDIR /app is the
repository), each with --dry-run, all in one Python process so that SGLang is imported once.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from router.config import RouterConfig
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
GPU_WORKERS = {"prefill": "prefill.py", "decode": "decode.py"}
CPU_WORKERS = {"prefill-cpu": "prefill.py", "decode-cpu": "decode.py"}
WORKERS = {**GPU_WORKERS, **CPU_WORKERS}
CONTROL = {"bootstrap", "router", "planner"}


class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; Compose rejects the file. So does this loader."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key_node.value!r}",
                                                        key_node.start_mark)
            seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def load_yaml(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_StrictLoader)  # a SafeLoader subclass


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE_FILE)


def compose_schema() -> dict:
    try:
        vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
        raw = (vendor / "compose-spec.json").read_bytes()
        expected = (vendor / "sha256" / "compose-spec.sha256").read_text().strip()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.fail(f"the Compose Specification schema is missing ({exc}): install the test extra (make setup)")
    assert hashlib.sha256(raw).hexdigest() == expected, "check-jsonschema's vendored compose-spec.json is corrupted"
    return json.loads(raw)


def schema_errors(document: dict) -> list[str]:
    schema = compose_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(document), key=lambda e: e.json_path)
    return [f"{error.json_path}: {error.message}" for error in errors]


def test_compose_file_matches_the_compose_specification(compose):
    assert schema_errors(compose) == []


def test_documented_rdma_options_are_valid_compose(compose):
    """x-rdma is documented for prefill and decode: with it added (and with host networking), still valid."""
    rdma = compose["x-rdma"]
    assert rdma["devices"] == ["/dev/infiniband:/dev/infiniband"] and rdma["cap_add"] == ["IPC_LOCK"]
    assert rdma["ulimits"]["memlock"] == -1
    for extra in ({}, {"network_mode": "host"}):
        variant = json.loads(json.dumps(compose))
        for name in GPU_WORKERS:
            variant["services"][name].update(rdma, **extra)
        assert schema_errors(variant) == [], extra


def test_topology_scales_and_splits_gpu_from_cpu(compose):
    services = compose["services"]
    assert set(services) == set(WORKERS) | CONTROL
    dotenv = (REPO / ".env").read_text()
    assert re.search(r"^COMPOSE_PROFILES=gpu$", dotenv, re.M), ".env must make the GPU profile the default"
    for name, service in services.items():
        assert "container_name" not in service, f"{name}: a fixed container name breaks --scale"
        assert service["restart"] == "unless-stopped" and service["init"] is True
        assert service["volumes"][0] == "./configs:/app/configs:ro", name
        build = service["build"]
        assert build["context"] == "." and build["dockerfile"] == "docker/Dockerfile"
        assert build["secrets"] == ["extra_ca"], f"{name}: the optional extra CA bundle, a build secret"
        extra = build["target"]
        assert service["image"] == f"pdcluster:{extra}", f"{name}: one tag per Dockerfile target"
        if name in GPU_WORKERS:
            assert service["profiles"] == ["gpu"] and extra == "gpu"
            devices = service["deploy"]["resources"]["reservations"]["devices"]
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        else:
            assert extra == "cpu" and "deploy" not in service, f"{name} needs no GPU"
            profiles = ["cpu"] if name in CPU_WORKERS else ["planner"] if name == "planner" else None
            assert service.get("profiles") == profiles, name
        if name != "bootstrap":
            assert service["depends_on"] == {"bootstrap": {"condition": "service_healthy"}}, name
        if name == "router":
            assert service["ports"] == ["${PDCLUSTER_PUBLISH_ADDR:-127.0.0.1}:${PDCLUSTER_PUBLISH_PORT:-8000}:8000"]
        else:
            assert "ports" not in service, f"{name}: only the router publishes a port"
    for a, b in (("prefill", "prefill-cpu"), ("decode", "decode-cpu")):
        assert services[a]["command"][:2] == services[b]["command"][:2]
    assert compose["secrets"] == {"extra_ca": {"file": "${PDCLUSTER_EXTRA_CA:-/dev/null}"}}


def test_dockerfile_has_both_targets_and_no_frontend_pull():
    """The targets compose names exist; no `# syntax=` line (BuildKit would pull a frontend image from a registry)."""
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    stages = {name: base for base, name in re.findall(r"^FROM (\S+) AS (\S+)$", dockerfile, re.M)}
    assert stages["cpu-system"] == "debian:bookworm-slim" and stages["cpu"] == "cpu-system"
    assert stages["gpu-system"].startswith("nvidia/cuda:") and stages["gpu"] == "gpu-system"
    assert not re.search(r"^#\s*syntax\s*=", dockerfile, re.M | re.I)


def service_config(service: dict) -> tuple[Path, dict]:
    command = service["command"]
    path = command[command.index("--config") + 1]
    assert path.startswith("configs/compose/"), path
    return REPO / path, load_yaml(REPO / path)


def test_health_checks_probe_each_service_on_its_configured_port(compose):
    for name, service in compose["services"].items():
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"] and "PDCLUSTER_HEALTH_URL" in test[3], name
        url = urlsplit(service["environment"]["PDCLUSTER_HEALTH_URL"])
        path, config = service_config(service)
        assert (url.hostname, url.port) == ("127.0.0.1", config["port"]), f"{name}: health URL vs {path.name}"
        assert url.path == ("/ready" if name == "router" else "/health"), name
        assert config["host"] == "0.0.0.0", f"{path.name}: must listen beyond the container's loopback"
        bootstrap_url = config.get("bootstrap_url") or (config.get("cluster") or {}).get("bootstrap_url")
        if name != "bootstrap":
            assert bootstrap_url == "http://bootstrap:8998", f"{path.name}: the bootstrap service's compose name"


# Runs each command in this one process: `python prefill.py ...` as runpy.run_path, `python -m router ...` as
# runpy.run_module. uvicorn.run is recorded instead of serving, and starting SGLang is an error.
RUNNER = r"""
import contextlib, io, json, runpy, sys
import uvicorn
from pdcluster.worker import supervisor

served = []
uvicorn.run = lambda app, **kwargs: served.append({k: kwargs.get(k) for k in ("host", "port")})
def no_sglang(self, *args, **kwargs):
    raise RuntimeError("a dry run started SGLang")
supervisor.Supervisor.run = no_sglang

results = []
for argv in json.loads(sys.argv[1]):
    out, err, served[:] = io.StringIO(), io.StringIO(), []
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[1] == "-m":
                sys.argv = [argv[2], *argv[3:]]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv[1:]
                runpy.run_path(argv[1], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "served": list(served)})
print("RESULTS " + json.dumps(results))
"""


def dry_run_argv(name: str, command: list[str]) -> list[str]:
    """The service's command, plus --dry-run; workers also get a port the OS reports free here (the config's port is
    the container's own: whatever listens on this machine must not fail the check)."""
    argv = list(command)
    if name in WORKERS:
        return [*argv, "--dry-run", "--port", str(free_port("0.0.0.0"))]
    if name == "bootstrap" and "--dry-run" not in (REPO / "bootstrap" / "__main__.py").read_text():
        return argv  # no --dry-run: it runs up to uvicorn.run, which the runner records instead of serving
    return [*argv, "--dry-run"]


def test_every_service_command_dry_runs(compose, demo_model, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the GPU model is a hub id, which the container downloads
    names = sorted(compose["services"])
    for name in names:
        command = compose["services"][name]["command"]
        assert command[0] == "python", f"{name}: the image's python (/opt/venv/bin/python)"
    runs = [dry_run_argv(name, compose["services"][name]["command"]) for name in names]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(runs)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "RESULTS " in proc.stdout, proc.stderr[-3000:]
    results = dict(zip(names, json.loads(proc.stdout.rsplit("RESULTS ", 1)[1]), strict=True))
    for name, argv in zip(names, runs, strict=True):
        result = results[name]
        assert result["code"] == 0, f"{name}: {' '.join(argv)}\n{result['stdout']}{result['stderr']}"

    for name in WORKERS:
        out = results[name]["stdout"]
        assert "-m sglang.launch_server" in out and "--host 0.0.0.0" in out, out
        assert results[name]["served"] == []
    for name in GPU_WORKERS:
        out = results[name]["stdout"]
        assert "--model-path Qwen/Qwen2.5-0.5B-Instruct" in out and "--device cpu" not in out, out
        assert "--disaggregation-transfer-backend mooncake_tcp" in out, out
    for name in CPU_WORKERS:
        out = results[name]["stdout"]
        assert "--model-path models/smollm2-135m-instruct" in out and "--device cpu" in out, out
        assert "--dtype float32" in out, out
    planner = json.loads(results["planner"]["stdout"])
    assert (planner["host"], planner["router_url"], planner["bootstrap_url"], planner["mode"]) == (
        "0.0.0.0", "http://router:8000", "http://bootstrap:8998", "recommend")
    router = json.loads(results["router"]["stdout"])
    assert (router["host"], router["port"], router["bootstrap_url"]) == ("0.0.0.0", 8000, "http://bootstrap:8998")
    assert results["router"]["served"] == []
    if "--dry-run" not in runs[names.index("bootstrap")]:
        assert results["bootstrap"]["served"] == [{"host": "0.0.0.0", "port": 8998}]


def test_the_routers_sqlite_store_is_a_named_volume(compose):
    """The router's store (configs/compose/router.yaml: SQLite at its default, under WORKDIR /app) is on a named
    volume: stored responses and conversations survive `docker compose down` and `up` (a new container)."""
    store = RouterConfig(**load_yaml(REPO / "configs" / "compose" / "router.yaml")).store
    assert store.backend == "sqlite"
    folder = "/app/" + Path(store.resolved_url().removeprefix("sqlite+aiosqlite:///")).parent.as_posix()
    mounts = dict(volume.split(":", 1)[::-1] for volume in compose["services"]["router"]["volumes"][1:])
    assert folder in mounts, f"no volume at {folder}: {compose['services']['router']['volumes']}"
    assert mounts[folder] in compose["volumes"], "a named volume, declared at the top level"
