"""The chart's planner (planner.enabled, off by default): its Deployment and config, the headless Service it reads
every router through, and the autoscalers (planner.autoscaling) that scale the workers to its metric.

KEDA's ScaledObject is a custom resource whose schema kubernetes-validate does not ship (and nothing here vendors
KEDA's CRD): its fields are checked against what KEDA documents for keda.sh/v1alpha1, its target against the rendered
workloads, and its query against the metric the planner really exports. The HPA is checked by Kubernetes' own schema
in test_lint_and_schemas.py, and here the same way against the workloads and the metric.
"""

from __future__ import annotations

import re

import yaml

from planner.config import PlannerConfig
from planner.exported import PlannerMetrics
from tests.unit.helm.chart import (
    NAMESPACE,
    PREFIX,
    REPO,
    WORKERS,
    by_kind,
    config_file,
    container,
    env_of,
    workloads,
)


def exported_series() -> dict[str, set[str]]:
    """The planner's series and their label names, as planner/exported.py registers them (the needed workers once a
    decision set them: before it the series is absent, and an autoscaler holds the replicas it has)."""
    metrics = PlannerMetrics()
    metrics.needed.labels(role="prefill").set(2)
    return {family.name: {label for sample in family.samples for label in sample.labels}
            for family in metrics.registry.collect()}


def test_off_by_default_and_the_workers_keep_their_replicas(rendered):
    docs = rendered["default"]
    assert "planner" not in workloads(docs) and f"{PREFIX}-planner" not in by_kind(docs, "ConfigMap")
    assert not {d["kind"] for d in docs} & {"ScaledObject", "HorizontalPodAutoscaler"}
    assert f"{PREFIX}-router-pods" not in by_kind(docs, "Service")
    for role in WORKERS:
        assert workloads(docs)[role]["spec"]["replicas"] == 1


def test_the_planner_runs_the_compose_config_against_this_releases_routers_and_registry(rendered):
    docs = rendered["planner"]
    deployment = workloads(docs)["planner"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    ctr = container(deployment)
    assert ctr["command"] == ["python", "-m", "planner", "--config", "/etc/pdcluster/planner.yaml"]
    assert ctr["image"].endswith(":cpu") and ctr["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert env_of(ctr)["PDCLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
    config = config_file(docs, "planner")
    assert config["router_url"] == f"http://{PREFIX}-router-pods.{NAMESPACE}.svc:8000"
    assert config["bootstrap_url"] == f"http://{PREFIX}-bootstrap.{NAMESPACE}.svc:8998"
    compose = yaml.safe_load((REPO / "configs" / "compose" / "planner.yaml").read_text())
    strip = ("router_url", "bootstrap_url", "mode")
    assert {k: v for k, v in config.items() if k not in strip} == {k: v for k, v in compose.items() if k not in strip}
    assert config["mode"] == "act"
    PlannerConfig.model_validate(config)
    assert (REPO / config["profile"]).is_file(), "the profile must be in the image (/app is the repository)"
    headless = by_kind(docs, "Service")[f"{PREFIX}-router-pods"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    assert headless["metadata"]["labels"]["app.kubernetes.io/component"] == "router-pods"  # not the router's monitor
    monitors = by_kind(docs, "ServiceMonitor").values()
    assert "planner" in {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors}


def test_keda_scales_each_worker_deployment_to_the_planners_needed_workers(rendered):
    docs = rendered["planner-keda"]
    objects = by_kind(docs, "ScaledObject")
    assert set(objects) == {f"{PREFIX}-{role}" for role in WORKERS}
    series = exported_series()
    for role in WORKERS:
        workload = workloads(docs)[role]
        assert "replicas" not in workload["spec"], "the autoscaler owns the replica count"
        scaled = objects[f"{PREFIX}-{role}"]
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        spec = scaled["spec"]
        assert set(spec) == {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "triggers"}
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": workload["kind"],
                                          "name": workload["metadata"]["name"]}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (1, 6, 30)
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        metadata = trigger["metadata"]
        assert set(metadata) == {"serverAddress", "query", "threshold", "ignoreNullValues"}
        assert metadata["threshold"] == "1"
        assert metadata["ignoreNullValues"] == "false", "no series yet (no decision) must not read as 0 replicas"
        assert re.match(r"^https?://", metadata["serverAddress"])
        name, labels = re.fullmatch(r"max\((\w+)\{(.*)\}\)", metadata["query"]).groups()
        assert name in series and "role" in series[name]
        assert labels == f'role="{role}", namespace="{NAMESPACE}"'


def test_an_hpa_on_the_external_metric_scales_statefulset_workers_too(rendered):
    docs = rendered["planner-hpa"]
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    series = exported_series()
    for role in WORKERS:
        workload = workloads(docs)[role]
        assert workload["kind"] == "StatefulSet" and "replicas" not in workload["spec"]
        spec = hpas[f"{PREFIX}-{role}"]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                          "name": workload["metadata"]["name"]}
        (metric,) = spec["metrics"]
        external = metric["external"]
        assert external["metric"]["name"] in series
        assert external["metric"]["selector"] == {"matchLabels": {"role": role}}
        assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
