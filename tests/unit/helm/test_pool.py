"""The chart's role-flexible worker pool (workers.pool, off by default): one Deployment of switch-enabled workers whose
roles the registry holds, beside a fixed prefill and decode workload that keep a worker of each role whatever
Kubernetes removes; the pool's pods pass the launcher's validation switch-enabled in the role they start in, outlast a
flip's worst case before their liveness probe kills them, and are what the autoscaler scales, to the planner's
pool metric. Lint, values schema and Kubernetes' own schemas: test_lint_and_schemas.py (the pool-* variants)."""

from __future__ import annotations

import re

import pytest

from pdcluster.worker import checks, role_flip
from tests.unit.helm.chart import (
    NAMESPACE,
    PREFIX,
    RELEASE,
    REPO,
    WORKERS,
    by_kind,
    config_file,
    container,
    ctr_port,
    helm,
    pod_spec,
    workloads,
)
from tests.unit.helm.test_configs import launch_plan
from tests.unit.helm.test_planner import exported_series

POOL = {"workers": {"pool": {"enabled": True}}}
FLIP_WORST_CASE = role_flip.SWITCH_TIMEOUT + role_flip.HEALTH_TIMEOUT


def test_the_pool_is_one_deployment_beside_fixed_prefill_and_decode_workers(rendered):
    docs = rendered["pool"]
    assert set(workloads(docs)) == {"bootstrap", "router", "pool", *WORKERS}
    pool = workloads(docs)["pool"]
    assert pool["kind"] == "Deployment" and pool["spec"]["replicas"] == 2
    assert container(pool)["command"][:4] == ["python", "prefill.py", "--config", "/etc/pdcluster/pool.yaml"]
    for role in WORKERS:  # the fixed ones: workers.pool.minPerRole each, not prefill.replicas / decode.replicas
        assert workloads(docs)[role]["spec"]["replicas"] == 1
        assert config_file(docs, role)["cluster"]["role_switch"] is False, "the planner must never flip them"
    assert not {d["kind"] for d in docs} & {"ScaledObject", "HorizontalPodAutoscaler"}
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/component"] == "pool"
    for doc in docs:  # no other workload's Service, budget or monitor selects the pool's pods, nor its theirs
        if doc["kind"] in ("Service", "PodDisruptionBudget"):
            chosen = doc["spec"].get("selector", {})
            chosen = chosen.get("matchLabels", chosen)
            assert (chosen.get("app.kubernetes.io/component") == "pool") == doc["metadata"]["name"].endswith("-pool")
    assert by_kind(docs, "PodDisruptionBudget")[f"{PREFIX}-pool"]["spec"]["maxUnavailable"] == 1
    assert f"{PREFIX}-pool" in by_kind(docs, "ServiceMonitor")
    assert {p["name"]: p["port"] for p in by_kind(docs, "Service")[f"{PREFIX}-pool"]["spec"]["ports"]} == {
        "http": 30100, "kv-bootstrap": 8999}


@pytest.mark.parametrize(("variant", "start_as"), [("pool", "prefill"), ("cpu-pool-hpa", "decode")])
def test_a_pool_pod_starts_switch_enabled_with_what_either_role_needs(rendered, variant, start_as, demo_model,
                                                                     tmp_path, monkeypatch):
    """The launcher's own validation of the pod's command: switch-enabled, its KV bootstrap server on the port the pod
    declares, a KV-events publisher, no kv_store (a flip would clear its pages); the fixed workers are not."""
    docs = rendered[variant]
    app = tmp_path / "app"
    app.mkdir()
    (app / "models").symlink_to(REPO / "models")
    monkeypatch.chdir(app)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # Ports belong to the pod, not to this machine (where a local cluster may hold 8999 and 5557).
    monkeypatch.setattr(checks, "check_port_free", lambda *args: None)
    monkeypatch.setattr(checks, "port_is_free", lambda *args: True)
    plan, _ = launch_plan(docs, start_as, app, component="pool")
    registration = plan.registration
    assert registration.role.value == start_as and registration.switch_enabled
    assert "--enable-pd-role-switch" in plan.command and plan.cluster.kv_store is None and "--dir" not in plan.command
    assert plan.flip is not None and plan.flip.kv_events is not None
    assert plan.flip.kv_bootstrap_port == ctr_port(container(workloads(docs)["pool"]), "kv-bootstrap")
    assert registration.identity.transfer_backend == "mooncake_tcp"
    for role in WORKERS:
        fixed, _ = launch_plan(docs, role, app)
        assert not fixed.registration.switch_enabled and "--enable-pd-role-switch" not in fixed.command
        # The registry marks a worker of another identity incompatible: it would never be paired with the pool's.
        assert fixed.registration.identity == registration.identity, "one model and KV page size across the fleet"


def test_a_pool_pods_liveness_outlasts_a_flips_worst_case_and_shorter_is_refused(chart, rendered):
    """SGLang's /health may not answer while a flip runs; the launcher gives it SWITCH_TIMEOUT + HEALTH_TIMEOUT before
    it restarts SGLang in the old role itself: a probe that gave up sooner would kill a pod mid-flip."""
    probe = container(workloads(rendered["pool"])["pool"])["livenessProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": "http"}
    assert probe["periodSeconds"] * probe["failureThreshold"] >= FLIP_WORST_CASE
    exactly = {"workers": {"pool": {"enabled": True, "livenessProbe": {
        "periodSeconds": 1, "failureThreshold": int(FLIP_WORST_CASE)}}}}
    assert "pdcluster/templates/workers.yaml" in chart.render(exactly, name=RELEASE, namespace=NAMESPACE)
    exactly["workers"]["pool"]["livenessProbe"]["failureThreshold"] -= 1
    with pytest.raises(helm.HelmError, match=r"at least 240 s"):
        chart.render(exactly, name=RELEASE, namespace=NAMESPACE)
    # The fixed workers keep their own role's probe.
    fixed = container(workloads(rendered["pool"])["decode"])["livenessProbe"]
    assert (fixed["periodSeconds"], fixed["failureThreshold"]) == (30, 5)


def test_keda_scales_the_pool_alone_to_the_planners_pool_metric(rendered):
    docs = rendered["pool-keda"]
    (scaled,) = by_kind(docs, "ScaledObject").values()
    pool = workloads(docs)["pool"]
    assert "replicas" not in pool["spec"], "the autoscaler owns the pool's replica count"
    for role in WORKERS:
        assert workloads(docs)[role]["spec"]["replicas"] == 2, "the fixed ones: workers.pool.minPerRole"
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                "name": pool["metadata"]["name"]}
    (trigger,) = scaled["spec"]["triggers"]
    name, labels = re.fullmatch(r"max\((\w+)\{(.*)\}\)", trigger["metadata"]["query"]).groups()
    assert name == "pdcluster_planner_desired_pool_workers" and name in exported_series()
    assert labels == f'namespace="{NAMESPACE}"'
    assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"


def test_an_hpa_scales_the_pool_on_the_external_pool_metric(rendered):
    docs = rendered["cpu-pool-hpa"]
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    pool = workloads(docs)["pool"]
    assert pool["kind"] == "Deployment" and "replicas" not in pool["spec"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == pool["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"] == {"name": "pdcluster_planner_desired_pool_workers"}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    for role in WORKERS:  # fixed: not scaled
        assert workloads(docs)[role]["spec"]["replicas"] == 1
        assert config_file(docs, role)["cluster"].get("kv_store") is None
    # No worker has a kv_store: the CPU profile's (values-cpu.yaml) is dropped, and with it the volume.
    for component in ("pool", *WORKERS):
        assert "kv-cache" not in {v["name"] for v in pod_spec(workloads(docs)[component])["volumes"]}
    assert container(pool)["image"].endswith(":cpu") and container(pool)["command"][1] == "decode.py"


@pytest.mark.parametrize(("values", "complaint"), [
    ({"workers": {"pool": {"config": {"cluster": {"kv_store": "kv-cache"}}}}}, "cannot have a kv_store"),
    ({"workers": {"pool": {"config": {"cluster": {"role_switch": False}}}}}, "need the role switch"),
    ({"workers": {"pool": {"config": {"enable-pd-role-switch": False}}}}, "need the role switch"),
    ({"workers": {"pool": {"config": {"disaggregation-transfer-backend": "fake"}}}}, "Mooncake transfer backend"),
    ({"rdma": {"enabled": True, "hostNetwork": True, "resources": {"rdma/hca": 1}}}, "rdma.hostNetwork"),
    ({"prefill": {"config": {"enable-pd-role-switch": True}}}, "pool's fixed ones"),
    ({"persistence": {"enabled": True}}, "nothing to persist"),
])
def test_the_chart_refuses_a_pool_that_could_not_flip_or_keep_its_roles(chart, values, complaint):
    values = {**values, "workers": {"pool": {"enabled": True, **values.get("workers", {}).get("pool", {})}}}
    with pytest.raises(helm.HelmError, match=re.escape(complaint)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_notes_tell_to_scale_the_pool(chart):
    notes = chart.render(POOL, name=RELEASE, namespace=NAMESPACE)["pdcluster/templates/NOTES.txt"]
    assert f"scale deployment/{PREFIX}-pool" in notes and f"deployment/{PREFIX}-prefill" not in notes
