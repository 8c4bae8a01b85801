"""How the release's objects find each other, and what it exposes: references, selectors, replicas, Services,
Ingress, the Helm test, update strategies, readiness."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.unit.helm.chart import (
    API_KEY,
    CHART,
    NAMESPACE,
    PREFIX,
    RELEASE,
    VARIANTS,
    WORKERS,
    by_kind,
    config_file,
    container,
    ctr_port,
    deep_merge,
    env_of,
    helm,
    matches,
    pod_spec,
    render,
    workloads,
)


def test_references_resolve_inside_the_release(rendered):
    """What `kubectl apply` would accept but a cluster would not run: a volume naming a ConfigMap, Secret or claim that
    is not there, a Service or budget selecting no pod, a probe or Ingress naming a port nobody declares."""
    for variant, docs in rendered.items():
        values = deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), VARIANTS[variant])
        external_secret = values["secrets"]["existingSecret"]
        external_claims = {values["persistence"]["existingClaim"], values["modelCache"]["existingClaim"]} - {""}
        configmaps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
        claims, accounts = by_kind(docs, "PersistentVolumeClaim"), by_kind(docs, "ServiceAccount")
        services = by_kind(docs, "Service")
        pods = {name: doc["spec"]["template"] for name, doc in by_kind(docs, "Deployment").items()}
        pods |= {name: doc["spec"]["template"] for name, doc in by_kind(docs, "StatefulSet").items()}
        for name, template in pods.items():
            where = f"{variant}: {name}"
            spec = template["spec"]
            assert spec["serviceAccountName"] in accounts, where
            for volume in spec["volumes"]:
                if "configMap" in volume:
                    assert volume["configMap"]["name"] in configmaps, where
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in set(claims) | external_claims, where
            (ctr,) = spec["containers"]
            mounts = {m["name"] for m in ctr["volumeMounts"]}
            templates = {t["metadata"]["name"] for t in
                         (by_kind(docs, "StatefulSet").get(name, {}).get("spec", {}).get("volumeClaimTemplates", []))}
            assert mounts <= {v["name"] for v in spec["volumes"]} | templates, where
            for item in ctr["env"]:
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    if external_secret:
                        assert ref["name"] == external_secret, where
                    else:
                        secret = secrets[ref["name"]]
                        assert ref["key"] in secret["data"] or ref.get("optional"), f"{where}: {ref}"
            port_names = {p["name"] for p in ctr["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in ctr:
                    assert ctr[probe]["httpGet"]["port"] in port_names, f"{where}: {probe}"
        for name, service in services.items():
            selected = [n for n, t in pods.items() if matches(service["spec"]["selector"], t["metadata"]["labels"])]
            workload = name.removesuffix("-pods")  # <router>-pods: the routers' headless Service, for the planner
            assert selected == [workload], f"{variant}: Service {name} selects {selected}"
            ctr_ports = {p["name"] for p in container(by_kind(docs, "Deployment").get(workload)
                                                      or by_kind(docs, "StatefulSet")[workload])["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= ctr_ports, name
        for name, budget in by_kind(docs, "PodDisruptionBudget").items():
            selected = [n for n, t in pods.items()
                        if matches(budget["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])]
            assert selected == [name], f"{variant}: budget {name} selects {selected}"
        for ingress in by_kind(docs, "Ingress").values():
            for rule in ingress["spec"]["rules"]:
                for path in rule["http"]["paths"]:
                    backend = path["backend"]["service"]
                    ports = {p["name"] for p in services[backend["name"]]["spec"]["ports"]}
                    assert backend["name"] == f"{PREFIX}-router" and backend["port"]["name"] in ports


def test_replica_counts_follow_values(rendered):
    for variant, expected in (("default", (1, 1, 2)), ("3p5d", (3, 5, 2)), ("cpu", (1, 1, 1)),
                              ("cpu-everything", (2, 3, 1)), ("persistence-perpod", (1, 1, 2))):
        found = workloads(rendered[variant])
        replicas = tuple(found[c]["spec"]["replicas"] for c in ("prefill", "decode", "router"))
        assert replicas == expected, variant
        assert found["bootstrap"]["spec"]["replicas"] == 1, "the registry is in memory: one replica"
        assert found["bootstrap"]["spec"]["strategy"] == {"type": "Recreate"}, "never two registries at once"


def test_workers_advertise_their_pod_ip_through_the_downward_api(rendered):
    for variant, docs in rendered.items():
        for role in WORKERS:
            ctr = container(workloads(docs)[role])
            env = env_of(ctr)
            assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, variant
            assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, variant
            command = ctr["command"]
            assert command[:2] == ["python", f"{role}.py"], variant
            pairs = [command[i + 1] for i, token in enumerate(command) if token == "--cluster"]
            assert "advertise_host=$(POD_IP)" in pairs and "worker_id=$(POD_NAME)" in pairs, command
            for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(command)):
                assert name in env, f"{variant}: $({name}) is not in the container's environment"


def test_only_the_router_is_meant_to_be_public(rendered):
    for variant, docs in rendered.items():
        for name, service in by_kind(docs, "Service").items():
            if name != f"{PREFIX}-router":
                assert service["spec"]["type"] == "ClusterIP", f"{variant}: {name}"
        for name, workload in workloads(docs).items():
            assert all("hostPort" not in p for p in container(workload)["ports"]), f"{variant}: {name}"
            if name in ("bootstrap", "router") or not variant.startswith("rdma-hostnetwork"):
                assert not pod_spec(workload).get("hostNetwork"), f"{variant}: {name}"
        ingresses = by_kind(docs, "Ingress")
        assert all(r["http"]["paths"][0]["backend"]["service"]["name"] == f"{PREFIX}-router"
                   for i in ingresses.values() for r in i["spec"]["rules"])
    assert by_kind(rendered["loadbalancer"], "Service")[f"{PREFIX}-router"]["spec"]["type"] == "LoadBalancer"
    headless = by_kind(rendered["default"], "Service")
    assert headless[f"{PREFIX}-prefill"]["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in headless[f"{PREFIX}-prefill"]["spec"]["ports"]} == {"http", "kv-bootstrap"}


@pytest.mark.parametrize("exposure", [{"router": {"ingress": {"enabled": True}}},
                                      {"router": {"service": {"type": "NodePort"}}}])
def test_an_exposed_router_needs_an_api_key(chart, exposure):
    with pytest.raises(helm.HelmError, match="without an API key"):
        chart.render(exposure, name=RELEASE, namespace=NAMESPACE)
    render(chart, deep_merge(exposure, {"router": {"allowUnauthenticated": True}}))
    render(chart, deep_merge(exposure, API_KEY))


def test_ingress_publishes_the_api_only(rendered):
    (ingress,) = by_kind(rendered["ingress"], "Ingress").values()
    (rule,) = ingress["spec"]["rules"]
    paths = {p["path"] for p in rule["http"]["paths"]}
    assert paths == {"/generate", "/v1", "/get_model_info"}, "/ready and /metrics list workers and need no key"
    assert ingress["spec"]["tls"] == [{"secretName": "pdcluster-tls", "hosts": ["pdcluster.example.com"]}]


def test_helm_test_generates_through_the_router(rendered):
    for variant in ("default", "cpu-everything"):
        (pod,) = by_kind(rendered[variant], "Pod").values()
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        env = env_of(pod["spec"]["containers"][0])
        service = by_kind(rendered[variant], "Service")[f"{PREFIX}-router"]
        port = service["spec"]["ports"][0]["port"]
        assert env["ROUTER_URL"]["value"] == f"http://{PREFIX}-router.{NAMESPACE}.svc:{port}"
        assert env["PDCLUSTER_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "apiKey"
        script = pod["spec"]["containers"][0]["command"][2]
        compile(script, "helm-test", "exec")
        assert "/ready" in script and "/generate" in script


def test_update_strategy_must_fit_the_workload_kind(chart):
    with pytest.raises(helm.HelmError, match="does not apply to a Deployment"):
        render(chart, {"decode": {"updateStrategy": {"type": "OnDelete"}}})
    with pytest.raises(helm.HelmError, match="does not apply to a StatefulSet"):
        render(chart, {"persistence": {"enabled": True, "mode": "perPod"}, "prefill": {"updateStrategy": {
            "type": "Recreate", "rollingUpdate": None}}})
    (statefulset,) = [w for w in by_kind(render(chart, {"persistence": {"enabled": True, "mode": "perPod"},
                                                        "prefill": {"updateStrategy": {"type": "OnDelete"}}}),
                                         "StatefulSet").values() if w["metadata"]["name"].endswith("-prefill")]
    assert statefulset["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_router_readiness_is_ready_on_its_configured_port(rendered):
    for variant, docs in rendered.items():
        router = container(workloads(docs)["router"])
        port = config_file(docs, "router")["port"]
        assert ctr_port(router, "http") == port
        assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}, variant
        assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}, variant
        assert router["command"] == ["python", "-m", "router", "--config", "/etc/pdcluster/router.yaml"]
        service = by_kind(docs, "Service")[f"{PREFIX}-router"]
        assert service["spec"]["ports"][0]["targetPort"] == "http"
