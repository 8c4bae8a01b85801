"""deploy/helm/pdcluster as the tests in this package see it: the values variants they render, Helm's own engine to
render them, and helpers to read the rendered manifests.

No cluster and no network. Both tools are pinned in the `test` extra (`make setup` installs them):
`helm-python-sdk` bundles Helm's Go SDK (render, `lint --strict`, values.schema.json), and `kubernetes-validate`
ships the Kubernetes JSON schemas in its wheel (checked in strict mode, which also rejects unknown fields).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "pdcluster"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "demo", "llm"
PREFIX = f"{RELEASE}-pdcluster"
WORKERS = ("prefill", "decode")
POD_IP = "10.42.3.17"


def _import(module: str):
    try:
        return __import__(module)
    except ImportError as exc:
        pytest.fail(f"{module} is missing ({exc}): install the test extra (make setup)")


helm = _import("helm_python")
kubernetes_validate = _import("kubernetes_validate")


def deep_merge(*layers: dict) -> dict:
    """Values files layered as `helm -f a -f b` does (None is kept: Helm itself deletes those keys)."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = deep_merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


CPU = yaml.safe_load((CHART / "values-cpu.yaml").read_text())
API_KEY = {"secrets": {"apiKey": "key-for-tests"}}
VARIANTS: dict[str, dict] = {
    "default": {},
    "cpu": CPU,
    "rdma": {"rdma": {"enabled": True, "device": "mlx5_0", "resources": {"rdma/hca": 1}}},
    "rdma-hostnetwork": {"rdma": {"enabled": True, "hostNetwork": True, "runAsRoot": False,
                                  "resources": {"rdma/rdma_shared_device_a": 1}}},
    "ingress": deep_merge(API_KEY, {"router": {"ingress": {
        "enabled": True, "className": "nginx",
        "tls": [{"secretName": "pdcluster-tls", "hosts": ["pdcluster.example.com"]}]}}}),
    "loadbalancer": deep_merge(API_KEY, {"router": {"service": {"type": "LoadBalancer",
                                                                "loadBalancerSourceRanges": ["10.0.0.0/8"]}}}),
    "persistence-shared": {"persistence": {"enabled": True}},
    "persistence-perpod": {"persistence": {"enabled": True, "mode": "perPod", "storageClassName": "fast"}},
    "servicemonitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "3p5d": {"prefill": {"replicas": 3}, "decode": {"replicas": 5}},
    "planner": {"planner": {"enabled": True, "config": {"mode": "act"}},
                "metrics": {"serviceMonitor": {"enabled": True}}},
    "planner-keda": {"planner": {"enabled": True, "autoscaling": {"enabled": True, "maxReplicas": 6}}},
    "planner-hpa": {"planner": {"enabled": True, "autoscaling": {"enabled": True, "kind": "hpa"}},
                    "persistence": {"enabled": True, "mode": "perPod"}},
    "pool": {"workers": {"pool": {"enabled": True}}, "metrics": {"serviceMonitor": {"enabled": True}}},
    "pool-keda": {"workers": {"pool": {"enabled": True, "minPerRole": 2}},
                  "planner": {"enabled": True, "config": {"mode": "act"}, "autoscaling": {"enabled": True}}},
    "cpu-pool-hpa": deep_merge(CPU, {"workers": {"pool": {"enabled": True, "startAs": "decode"}},
                                     "planner": {"enabled": True, "autoscaling": {"enabled": True, "kind": "hpa"}}}),
    "cpu-everything": deep_merge(CPU, API_KEY, {
        "secrets": {"existingSecret": "pdcluster-managed"},
        "persistence": {"enabled": True, "existingClaim": "shared-kv"},
        "modelCache": {"existingClaim": "hf-cache"},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "tracing": {"enabled": True, "endpoint": "http://otel-collector.observability:4317", "protocol": "grpc"},
        "router": {"ingress": {"enabled": True}},
        "prefill": {"replicas": 2, "config": {"tp-size": 1}}, "decode": {"replicas": 3}}),
}


def render(chart, values: dict) -> list[dict]:
    """Every non-empty manifest of the release, as `helm template demo -n llm` prints them."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    assert docs, "nothing rendered"
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    """component -> its Deployment or StatefulSet."""
    return {doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc for doc in docs
            if doc["kind"] in ("Deployment", "StatefulSet")}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    (only,) = pod_spec(workload)["containers"]
    return only


def env_of(ctr: dict) -> dict[str, dict]:
    return {item["name"]: item for item in ctr.get("env", [])}


def config_file(docs: list[dict], component: str) -> dict:
    configmap = by_kind(docs, "ConfigMap")[f"{PREFIX}-{component}"]
    return yaml.safe_load(configmap["data"][f"{component}.yaml"])


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def ctr_port(ctr: dict, name: str) -> int:
    return next(p["containerPort"] for p in ctr["ports"] if p["name"] == name)


def kv_mount(workload: dict) -> str:
    return next(m["mountPath"] for m in container(workload)["volumeMounts"] if m["name"] == "kv-cache")
