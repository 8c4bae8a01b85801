"""The config files the chart deploys: the compose configs, and worker configs that pass the launcher's own
validation (`build_plan`, what `--dry-run` prints) with the pod's command line, Kubernetes' $(VAR) expansion done
as the kubelet does it."""

from __future__ import annotations

import argparse
import copy
import importlib
import re
from pathlib import Path

import pytest
import yaml

from tests.unit.helm.chart import (
    NAMESPACE,
    POD_IP,
    PREFIX,
    RELEASE,
    REPO,
    WORKERS,
    by_kind,
    config_file,
    container,
    ctr_port,
    env_of,
    kv_mount,
    pod_spec,
    workloads,
)


def strip(config: dict, *dotted: str) -> dict:
    config = copy.deepcopy(config)
    for key in dotted:
        *parents, last = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node.pop(last, None)
    return config


def compose_config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / "compose" / name).read_text())


def test_configs_are_compose_configs(rendered):
    """The chart deploys the compose configs: the CPU demo's exactly, the GPU ones but for two documented keys; only
    the bootstrap service's address differs (a Kubernetes Service instead of the compose service name), and the router
    keeps no store unless given one (its replicas would each keep their own)."""
    def chart_config(variant: str, component: str) -> dict:
        config = config_file(rendered[variant], component)
        if component in WORKERS:
            assert config["cluster"]["bootstrap_url"] == f"http://{PREFIX}-bootstrap.{NAMESPACE}.svc:8998"
            assert component == "decode" or config.pop("disaggregation-bootstrap-port") == 8999
            return strip(config, "cluster.bootstrap_url")
        if component == "router":  # no store: the replicas would each keep their own (a PostgreSQL is configured)
            assert config.pop("store") == {"backend": "none"}
        return strip(config, "bootstrap_url")

    for component in ("bootstrap", "router"):
        assert chart_config("default", component) == strip(compose_config(f"{component}.yaml"), "bootstrap_url")
    for role in WORKERS:
        assert chart_config("cpu", role) == strip(compose_config(f"{role}-cpu.yaml"), "cluster.bootstrap_url"), role
        expected = strip(compose_config(f"{role}.yaml"), "cluster.bootstrap_url", "mem-fraction-static")
        assert chart_config("default", role) == {**expected, "enable-metrics": True}, role


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def launch_plan(docs: list[dict], role: str, app_dir: Path, component: str | None = None):
    """What the pod's command would start: its ConfigMap written where the pod mounts it (under app_dir), its command
    run through the launcher's own parsing and validation (build_plan, as `--dry-run` does), from the WORKDIR.
    `component`: the workload, when not the role's own (workers.pool's pods start as a role)."""
    from pdcluster.worker.cli import _key_values
    from pdcluster.worker.plan import build_plan

    workload = workloads(docs)[component or role]
    ctr, spec = container(workload), pod_spec(workload)
    pod_name = f"{workload['metadata']['name']}-7d9f8c6b5-x2x4q"
    env = {name: item["value"] for name, item in env_of(ctr).items() if "value" in item}
    env |= {"POD_IP": POD_IP, "POD_NAME": pod_name, "PDCLUSTER_TOKEN": "t"}
    argv = [expand(token, env) for token in ctr["command"]]
    assert argv[:2] == ["python", f"{role}.py"]

    parser = argparse.ArgumentParser(allow_abbrev=False)  # pdcluster/worker/cli.py's own options
    parser.add_argument("--config")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--cluster", action="append", default=[])
    args, overrides = parser.parse_known_args(argv[2:])
    mount = next(m for m in ctr["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    configmap = by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]
    path = app_dir / args.config.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(configmap["data"][Path(args.config).name])
    rules = importlib.import_module(f"{role}.plan")  # what `python {role}.py` passes the launcher
    plan = build_plan(rules, str(path), overrides, env=env, cluster_overrides=_key_values(args.cluster))
    return plan, pod_name


@pytest.mark.parametrize("variant", ["default", "cpu", "rdma", "cpu-everything"])
def test_worker_configs_pass_the_launchers_validation(rendered, variant, demo_model, tmp_path, monkeypatch):
    from pdcluster.worker import checks

    docs = rendered[variant]
    app = tmp_path / "app"  # the image's WORKDIR, with the demo model where the cpu image has it
    app.mkdir()
    (app / "models").symlink_to(REPO / "models")
    monkeypatch.chdir(app)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the GPU model is a hub id, downloaded in the pod
    # Ports belong to the pod, not to this machine (where a local cluster may be running).
    monkeypatch.setattr(checks, "check_port_free", lambda *args: None)
    bootstrap_service = by_kind(docs, "Service")[f"{PREFIX}-bootstrap"]
    bootstrap_url = f"http://{PREFIX}-bootstrap.{NAMESPACE}.svc:{bootstrap_service['spec']['ports'][0]['port']}"
    for role in WORKERS:
        plan, pod_name = launch_plan(docs, role, app)
        ctr = container(workloads(docs)[role])
        port = ctr_port(ctr, "http")
        registration = plan.registration
        assert (registration.worker_id, str(registration.url).rstrip("/")) == (pod_name, f"http://{POD_IP}:{port}")
        assert plan.cluster.bootstrap_url == bootstrap_url
        assert plan.env_added["SGLANG_HOST_IP"] == POD_IP, "Mooncake and SGLang's ZMQ announce the pod's address"
        assert "--host 0.0.0.0" in plan.describe() and f"--port {port}" in plan.describe()
        if role == "prefill":
            kv_bootstrap = (registration.kv_bootstrap_host, registration.kv_bootstrap_port)
            assert kv_bootstrap == (POD_IP, ctr_port(ctr, "kv-bootstrap"))
        assert plan.cpu is variant.startswith("cpu"), variant
        backend = registration.identity.transfer_backend
        assert backend == {"rdma": "mooncake"}.get(variant, "mooncake_tcp"), variant
        if variant == "rdma":
            assert "--disaggregation-ib-device mlx5_0" in plan.describe()
        # kv_store: the launcher's directory is the volume's mount path (relative to /app in the image).
        kv_dir = plan.command[plan.command.index("--dir") + 1]
        assert "/app/" + str(Path(kv_dir).relative_to(app)) == kv_mount(workloads(docs)[role]), variant

    from bootstrap.config import BootstrapConfig
    from router.config import RouterConfig
    from router.pd.policies import REGISTRY

    bootstrap = BootstrapConfig.model_validate(config_file(docs, "bootstrap"))
    router = RouterConfig.model_validate(config_file(docs, "router"), context={"policies": REGISTRY})  # as loaded
    assert (bootstrap.host, bootstrap.port) == ("0.0.0.0", bootstrap_service["spec"]["ports"][0]["port"])
    assert (router.host, router.bootstrap_url) == ("0.0.0.0", bootstrap_url)
    assert router.api_key is None and bootstrap.token is None


def test_notes_tell_how_to_reach_ready_and_scale(chart):
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["pdcluster/templates/NOTES.txt"]
    assert "/ready" in notes and "/metrics" in notes
    assert f"scale deployment/{PREFIX}-prefill" in notes and f"scale deployment/{PREFIX}-decode" in notes
