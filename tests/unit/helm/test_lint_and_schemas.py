"""Helm's `lint --strict`, Kubernetes' own schemas (strict) for every rendered manifest, and the chart's values
schema against typos and against the config models it mirrors."""

from __future__ import annotations

import functools
import json

import pytest

from tests.unit.helm.chart import CHART, KUBE_VERSION, NAMESPACE, RELEASE, VARIANTS, helm, kubernetes_validate


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_strict_passes(variant):
    report = helm.lint(str(CHART), VARIANTS[variant], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon is recommended")
    assert report["errors"] == [] and problems == [], json.dumps(report, indent=1)


def test_every_manifest_validates_against_kubernetes_schemas_strictly(rendered, monkeypatch):
    """Strict: an unknown or misspelled field is an error too. The custom resources have no schema there:
    test_service_monitor_selects_the_metrics_ports checks the ServiceMonitor, test_planner.py KEDA's ScaledObject."""
    from kubernetes_validate import utils

    # validate() parses its schema files (1.2 MB of definitions) again for every manifest: once is enough here.
    monkeypatch.setattr(utils, "schema_contents", functools.lru_cache(maxsize=None)(utils.schema_contents))
    kinds = set()
    for variant, docs in rendered.items():
        for doc in docs:
            kinds.add(doc["kind"])
            if doc["apiVersion"].startswith(("monitoring.coreos.com/", "keda.sh/")):
                continue
            try:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}")
    assert kinds == {"ConfigMap", "Secret", "ServiceAccount", "Service", "Deployment", "StatefulSet",
                     "PodDisruptionBudget", "Ingress", "PersistentVolumeClaim", "ServiceMonitor", "Pod",
                     "ScaledObject", "HorizontalPodAutoscaler"}


@pytest.mark.parametrize(("values", "complaint"), [
    ({"prefill": {"replicas": "two"}}, "/prefill/replicas"),
    ({"decode": {"replica": 2}}, "'replica' not allowed"),
    ({"rdma": {"enabeld": True}}, "'enabeld' not allowed"),
    ({"persistence": {"mode": "perpod"}}, "/persistence/mode"),
    ({"router": {"service": {"type": "External"}}}, "/router/service/type"),
    ({"prefill": {"config": {"port": "30100"}}}, "/prefill/config/port"),
    ({"prefill": {"config": {"cluster": {"kv_stor": "kv-cache"}}}}, "'kv_stor' not allowed"),
    ({"decode": {"config": {"cluster": {"device": "gpu"}}}}, "/decode/config/cluster/device"),
    ({"router": {"config": {"prefill_polcy": "prefix"}}}, "'prefill_polcy' not allowed"),
    ({"router": {"config": {"store": {"backend": "redis"}}}}, "/router/config/store/backend"),
    # Secrets have no place in a config file, which lands in a ConfigMap: secrets.* instead.
    ({"bootstrap": {"config": {"token": "t"}}}, "'token' not allowed"),
    ({"router": {"config": {"api_key": "k"}}}, "'api_key' not allowed"),
    ({"prefill": {"config": {"cluster": {"token": "t"}}}}, "'token' not allowed"),
    # Set per pod by the chart: one value for every replica would be wrong.
    ({"decode": {"config": {"cluster": {"advertise_host": "10.0.0.1"}}}}, "'advertise_host' not allowed"),
    ({"prefill": {"shmSize": "lots"}}, "/prefill/shmSize"),
    ({"planner": {"config": {"mode": "flip"}}}, "/planner/config/mode"),
    ({"planner": {"config": {"token": "t"}}}, "'token' not allowed"),
    ({"planner": {"autoscaling": {"kind": "vpa"}}}, "/planner/autoscaling/kind"),
    ({"workers": {"pool": {"startAs": "both"}}}, "/workers/pool/startAs"),
    ({"workers": {"pool": {"minPerRole": 0}}}, "/workers/pool/minPerRole"),  # the router needs one of each role
    ({"workers": {"pool": {"enable": True}}}, "'enable' not allowed"),
    ({"workers": {"pool": {"livenessProbe": {"periodSecond": 60}}}}, "'periodSecond' not allowed"),
    ({"workers": {"pool": {"config": {"cluster": {"token": "t"}}}}}, "'token' not allowed"),
])
def test_values_schema_rejects_typos_and_bad_types(chart, values, complaint):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert complaint in str(caught.value)


def test_values_schema_follows_the_config_models():
    """The schema's closed key lists are the pydantic models' fields, minus what the chart owns (secrets, per-pod
    identity): a field added to a model without the schema fails here, not in a user's install."""
    from bootstrap.config import BootstrapConfig
    from pdcluster.worker.settings import ClusterSettings, KVStoreSettings
    from planner.config import PlannerConfig
    from router.config import RouterConfig, StaticWorker, StoreConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    definitions = schema["definitions"]
    kv_object = next(s for s in definitions["kvStore"]["anyOf"] if s.get("type") == "object")
    assert set(props["bootstrap"]["properties"]["config"]["properties"]) == (
        set(BootstrapConfig.model_fields) - {"token"})
    assert set(props["planner"]["properties"]["config"]["properties"]) == set(PlannerConfig.model_fields) - {"token"}
    assert set(props["router"]["properties"]["config"]["properties"]) == (
        set(RouterConfig.model_fields) - {"api_key", "bootstrap_token"})
    assert set(props["router"]["properties"]["config"]["properties"]["store"]["properties"]) == (
        set(StoreConfig.model_fields))
    for role in ("prefill", "decode"):  # static workers
        static = props["router"]["properties"]["config"]["properties"][role]["items"]["properties"]
        assert set(static) == set(StaticWorker.model_fields)
    assert set(definitions["workerConfig"]["properties"]["cluster"]["properties"]) == (
        set(ClusterSettings.model_fields) - {"token", "advertise_host", "worker_id"})
    assert set(kv_object["properties"]) == set(KVStoreSettings.model_fields)
