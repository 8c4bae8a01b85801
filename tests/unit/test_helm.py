"""deploy/helm/pdcluster: rendered and linted offline by Helm's own engine, every manifest checked against Kubernetes'
schemas, and the wiring checked the way a cluster would use it.

No cluster and no network. Both tools are pinned in the `test` extra (`make setup` installs them):
`helm-python-sdk` bundles Helm's Go SDK (render, `lint --strict`, values.schema.json), and `kubernetes-validate`
ships the Kubernetes JSON schemas in its wheel (checked here in strict mode, which also rejects unknown fields).
The worker ConfigMaps are run through the launcher's own validation (`build_plan`, what `--dry-run` prints), with the
command line of the pod: Kubernetes' $(VAR) expansion done as the kubelet does it.
"""

from __future__ import annotations

import argparse
import base64
import copy
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
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
    "cpu-everything": deep_merge(CPU, API_KEY, {
        "secrets": {"existingSecret": "pdcluster-managed"},
        "persistence": {"enabled": True, "existingClaim": "shared-kv"},
        "modelCache": {"existingClaim": "hf-cache"},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "router": {"ingress": {"enabled": True}},
        "prefill": {"replicas": 2, "config": {"tp-size": 1}}, "decode": {"replicas": 3}}),
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def render(chart, values: dict) -> list[dict]:
    """Every non-empty manifest of the release, as `helm template demo -n llm` prints them."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    assert docs, "nothing rendered"
    return docs


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, list[dict]]:
    return {name: render(chart, values) for name, values in VARIANTS.items()}


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


# --------------------------------------------------------------------------------------------------- Helm and schemas
@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_strict_passes(variant):
    report = helm.lint(str(CHART), VARIANTS[variant], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon is recommended")
    assert report["errors"] == [] and problems == [], json.dumps(report, indent=1)


def test_every_manifest_validates_against_kubernetes_schemas_strictly(rendered, monkeypatch):
    """Strict: an unknown or misspelled field is an error too. The one custom resource, ServiceMonitor, has no schema
    there: test_service_monitor_selects_the_metrics_ports checks it."""
    from kubernetes_validate import utils

    # validate() parses its schema files (1.2 MB of definitions) again for every manifest: once is enough here.
    monkeypatch.setattr(utils, "schema_contents", functools.lru_cache(maxsize=None)(utils.schema_contents))
    kinds = set()
    for variant, docs in rendered.items():
        for doc in docs:
            kinds.add(doc["kind"])
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            try:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}")
    assert kinds == {"ConfigMap", "Secret", "ServiceAccount", "Service", "Deployment", "StatefulSet",
                     "PodDisruptionBudget", "Ingress", "PersistentVolumeClaim", "ServiceMonitor", "Pod"}


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
    # Secrets have no place in a config file, which lands in a ConfigMap: secrets.* instead.
    ({"bootstrap": {"config": {"token": "t"}}}, "'token' not allowed"),
    ({"router": {"config": {"api_key": "k"}}}, "'api_key' not allowed"),
    ({"prefill": {"config": {"cluster": {"token": "t"}}}}, "'token' not allowed"),
    # Set per pod by the chart: one value for every replica would be wrong.
    ({"decode": {"config": {"cluster": {"advertise_host": "10.0.0.1"}}}}, "'advertise_host' not allowed"),
    ({"prefill": {"shmSize": "lots"}}, "/prefill/shmSize"),
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
    from router.config import RouterConfig, StaticWorker

    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    definitions = schema["definitions"]
    kv_object = next(s for s in definitions["kvStore"]["anyOf"] if s.get("type") == "object")
    assert set(props["bootstrap"]["properties"]["config"]["properties"]) == (
        set(BootstrapConfig.model_fields) - {"token"})
    assert set(props["router"]["properties"]["config"]["properties"]) == (
        set(RouterConfig.model_fields) - {"api_key", "bootstrap_token"})
    for role in ("prefill", "decode"):  # static workers, with the deprecated names still accepted
        static = props["router"]["properties"]["config"]["properties"][role]["items"]["properties"]
        assert set(static) == set(StaticWorker.model_fields) | {"bootstrap_host", "bootstrap_port"}
    assert set(definitions["workerConfig"]["properties"]["cluster"]["properties"]) == (
        set(ClusterSettings.model_fields) - {"token", "advertise_host", "worker_id"})
    assert set(kv_object["properties"]) == set(KVStoreSettings.model_fields)


# ------------------------------------------------------------------------------------------------------------ wiring
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
            assert selected == [name], f"{variant}: Service {name} selects {selected}"
            ctr_ports = {p["name"] for p in container(by_kind(docs, "Deployment").get(name)
                                                      or by_kind(docs, "StatefulSet")[name])["ports"]}
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


def ctr_port(ctr: dict, name: str) -> int:
    return next(p["containerPort"] for p in ctr["ports"] if p["name"] == name)


def test_workers_get_gpus_shm_and_probes_long_enough_for_a_model_load(rendered):
    from pdcluster.worker import supervisor
    from pdcluster.worker.settings import ClusterSettings

    ready_timeout = ClusterSettings().ready_timeout
    for variant, docs in rendered.items():
        gpu = not variant.startswith("cpu")
        for role in WORKERS:
            workload = workloads(docs)[role]
            ctr = container(workload)
            limits = ctr["resources"]["limits"]
            assert (limits.get("nvidia.com/gpu") == 1) is gpu, f"{variant}: {role}: {limits}"
            assert ctr["image"].endswith(":gpu" if gpu else ":cpu")
            shm = next(v for v in pod_spec(workload)["volumes"] if v["name"] == "shm")
            assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"], variant
            assert {"name": "shm", "mountPath": "/dev/shm"} in ctr["volumeMounts"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert ctr[probe]["httpGet"] == {"path": "/health", "port": "http"}, f"{variant}: {role}: {probe}"
                assert ctr[probe]["timeoutSeconds"] > 20, "SGLang's /health itself waits up to 20 s"
            startup = ctr["startupProbe"]
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= (ready_timeout if gpu else 120), f"{variant}: a startup budget of {budget}s"
            # SIGTERM: SGLang gets GRACE_SECONDS to stop, then the launcher's threads and its DELETE (~13 s).
            assert pod_spec(workload)["terminationGracePeriodSeconds"] >= supervisor.GRACE_SECONDS + 15
        for component in ("bootstrap", "router"):
            ctr = container(workloads(docs)[component])
            assert ctr["image"].endswith(":cpu") and "nvidia.com/gpu" not in ctr["resources"].get("limits", {})


def test_secrets_come_from_a_secret_never_from_a_configmap(chart):
    sentinels = {"token": "tok-3f9a-sentinel", "apiKey": "key-7c1e-sentinel", "hfToken": "hf-55d0-sentinel"}
    docs = render(chart, {"secrets": sentinels})
    (secret,) = by_kind(docs, "Secret").values()
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == sentinels
    for doc in docs:
        if doc is not secret:
            text = json.dumps(doc)
            assert not any(s in text for s in sentinels.values()), f"{doc['kind']}/{doc['metadata']['name']}"
    found = workloads(docs)
    expected = {"bootstrap": {"PDCLUSTER_TOKEN": "token"}, "router": {"PDCLUSTER_API_KEY": "apiKey"},
                "prefill": {"PDCLUSTER_TOKEN": "token", "HF_TOKEN": "hfToken"},
                "decode": {"PDCLUSTER_TOKEN": "token", "HF_TOKEN": "hfToken"}}
    for component, variables in expected.items():
        env = env_of(container(found[component]))
        for variable, key in variables.items():
            ref = env[variable]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], key), component
    # Nothing given: a token is generated (48 characters); no API key or HF token entries.
    (generated,) = by_kind(render(chart, {}), "Secret").values()
    assert set(generated["data"]) == {"token"} and len(base64.b64decode(generated["data"]["token"])) == 48
    # A Secret of one's own: none is rendered, every reference names it.
    docs = render(chart, {"secrets": {"existingSecret": "mine"}})
    assert by_kind(docs, "Secret") == {}
    refs = {item["valueFrom"]["secretKeyRef"]["name"] for w in workloads(docs).values()
            for item in container(w)["env"] if "secretKeyRef" in item.get("valueFrom", {})}
    assert refs == {"mine"}


def test_pods_have_no_api_access_and_run_unprivileged(rendered):
    for variant, docs in rendered.items():
        assert not {d["kind"] for d in docs} & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
        (account,) = by_kind(docs, "ServiceAccount").values()
        assert account["automountServiceAccountToken"] is False
        for name, workload in workloads(docs).items():
            spec, ctr = pod_spec(workload), container(workload)
            assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
            assert spec["shareProcessNamespace"] is True, "the pause container reaps, as compose's init: true"
            security = ctr["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and not security.get("privileged")
            assert security["capabilities"]["drop"] == ["ALL"]
            root = variant == "rdma" and name in WORKERS  # rdma.runAsRoot: IPC_LOCK needs root
            assert spec["securityContext"]["runAsNonRoot"] is not root, f"{variant}: {name}"
            assert (spec["securityContext"]["runAsUser"] == 0) is root, f"{variant}: {name}"
            if name in ("bootstrap", "router"):
                assert security["readOnlyRootFilesystem"] is True
                assert {"name": "tmp", "mountPath": "/tmp"} in ctr["volumeMounts"]


def test_rdma_selects_mooncake_over_rdma_and_asks_for_the_devices(chart, rendered):
    for variant in ("rdma", "rdma-hostnetwork"):
        docs = rendered[variant]
        for role in WORKERS:
            config = config_file(docs, role)
            assert config["disaggregation-transfer-backend"] == "mooncake", variant
            workload = workloads(docs)[role]
            ctr, spec = container(workload), pod_spec(workload)
            assert "IPC_LOCK" in ctr["securityContext"]["capabilities"]["add"]
            if variant == "rdma":
                assert config["disaggregation-ib-device"] == "mlx5_0"
                assert ctr["resources"]["limits"]["rdma/hca"] == 1 and "hostNetwork" not in spec
            else:
                assert "disaggregation-ib-device" not in config
                assert ctr["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
                assert "rdma/hca" not in ctr["resources"]["limits"]
                assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
                (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                assert term["topologyKey"] == "kubernetes.io/hostname"
                assert matches(term["labelSelector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"])
    for role in WORKERS:
        assert config_file(rendered["default"], role)["disaggregation-transfer-backend"] == "mooncake_tcp"
    with pytest.raises(helm.HelmError, match="rdma.enabled needs rdma.resources"):
        render(chart, {"rdma": {"enabled": True}})


def kv_mount(workload: dict) -> str:
    return next(m["mountPath"] for m in container(workload)["volumeMounts"] if m["name"] == "kv-cache")


def test_kv_cache_persistence_is_mounted_where_kv_store_points(chart, rendered):
    # Off: an emptyDir where each role's kv_store.dir is (/app is the image's WORKDIR).
    for role in WORKERS:
        workload = workloads(rendered["default"])[role]
        assert kv_mount(workload) == "/app/kv-cache"
        assert {"name": "kv-cache", "emptyDir": {}} in pod_spec(workload)["volumes"]
    # shared: one ReadWriteMany claim, mounted by every prefill and decode (compose's kv-cache volume).
    docs = rendered["persistence-shared"]
    (claim,) = by_kind(docs, "PersistentVolumeClaim").values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for role in WORKERS:
        workload = workloads(docs)[role]
        assert workload["kind"] == "Deployment" and kv_mount(workload) == "/app/kv-cache"
        volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == "kv-cache")
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # perPod: StatefulSets, a ReadWriteOnce claim per pod, named by the headless Service.
    docs = rendered["persistence-perpod"]
    assert by_kind(docs, "PersistentVolumeClaim") == {}
    for role in WORKERS:
        workload = workloads(docs)[role]
        assert workload["kind"] == "StatefulSet" and workload["spec"]["serviceName"] == f"{PREFIX}-{role}"
        (template,) = workload["spec"]["volumeClaimTemplates"]
        assert template["metadata"]["name"] == "kv-cache" and template["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert template["spec"]["storageClassName"] == "fast" and kv_mount(workload) == "/app/kv-cache"
    # A kv_store dir of one's own is followed; no kv_store, no volume.
    docs = render(chart, {"prefill": {"config": {"cluster": {"kv_store": {"dir": "/data/kv"}}}},
                           "decode": {"config": {"cluster": {"kv_store": None}}}})
    assert kv_mount(workloads(docs)["prefill"]) == "/data/kv"
    assert "kv-cache" not in {m["name"] for m in container(workloads(docs)["decode"])["volumeMounts"]}


def test_service_monitor_selects_the_metrics_ports(rendered):
    for variant, scraped in (("servicemonitor", {"router", "prefill", "decode"}), ("cpu-everything", {"router"})):
        docs = rendered[variant]
        monitors = by_kind(docs, "ServiceMonitor")
        assert {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors.values()} == scraped
        services = by_kind(docs, "Service")
        for monitor in monitors.values():
            assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
            assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
            (endpoint,) = monitor["spec"]["endpoints"]
            assert endpoint["path"] == "/metrics"
            targets = [s for s in services.values() if matches(monitor["spec"]["selector"]["matchLabels"],
                                                               s["metadata"]["labels"])]
            assert len(targets) == 1 and endpoint["port"] in {p["name"] for p in targets[0]["spec"]["ports"]}
        if variant == "servicemonitor":
            assert all(m["metadata"]["labels"]["release"] == "prom" for m in monitors.values())
    # Pod annotations: the router always; workers when SGLang's metrics are on (the GPU configs, not the CPU demo).
    for variant, annotated in (("default", {"router", "prefill", "decode"}), ("cpu", {"router"})):
        found = {name for name, w in workloads(rendered[variant]).items()
                 if w["spec"]["template"]["metadata"]["annotations"].get("prometheus.io/scrape") == "true"}
        assert found == annotated, variant


def test_config_changes_roll_the_pods(chart):
    before = workloads(render(chart, {}))
    after = workloads(render(chart, {"prefill": {"config": {"log-level": "info"}}}))
    annotation = "checksum/config"
    changed = {c for c in before if before[c]["spec"]["template"]["metadata"]["annotations"][annotation]
               != after[c]["spec"]["template"]["metadata"]["annotations"][annotation]}
    assert changed == {"prefill"}


# ------------------------------------------------------------------------------------------------ the config files
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
    the bootstrap service's address differs (a Kubernetes Service instead of the compose service name)."""
    def chart_config(variant: str, component: str) -> dict:
        config = config_file(rendered[variant], component)
        if component in WORKERS:
            assert config["cluster"]["bootstrap_url"] == f"http://{PREFIX}-bootstrap.{NAMESPACE}.svc:8998"
            assert component == "decode" or config.pop("disaggregation-bootstrap-port") == 8999
            return strip(config, "cluster.bootstrap_url")
        return strip(config, "bootstrap_url")

    for component in ("bootstrap", "router"):
        assert chart_config("default", component) == strip(compose_config(f"{component}.yaml"), "bootstrap_url")
    for role in WORKERS:
        assert chart_config("cpu", role) == strip(compose_config(f"{role}-cpu.yaml"), "cluster.bootstrap_url"), role
        expected = strip(compose_config(f"{role}.yaml"), "cluster.bootstrap_url", "mem-fraction-static")
        assert chart_config("default", role) == {**expected, "enable-metrics": True}, role


@pytest.fixture(scope="module")
def demo_model() -> Path:
    model = REPO / "models" / "tiny-llama"
    if not (model / "config.json").is_file():  # `make setup` builds it; the image has its own
        subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", "models/tiny-llama"], cwd=REPO,
                       check=True)
    return model


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def launch_plan(docs: list[dict], role: str, app_dir: Path):
    """What the pod's command would start: its ConfigMap written where the pod mounts it (under app_dir), its command
    run through the launcher's own parsing and validation (build_plan, as `--dry-run` does), from the WORKDIR."""
    from pdcluster.protocol import Role
    from pdcluster.worker.cli import _key_values
    from pdcluster.worker.plan import build_plan

    workload = workloads(docs)[role]
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
    plan = build_plan(Role(role), str(path), overrides, env=env, cluster_overrides=_key_values(args.cluster))
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
            assert (registration.bootstrap_host, registration.bootstrap_port) == (POD_IP, ctr_port(ctr, "kv-bootstrap"))
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

    bootstrap = BootstrapConfig.model_validate(config_file(docs, "bootstrap"))
    router = RouterConfig.model_validate(config_file(docs, "router"))
    assert (bootstrap.host, bootstrap.port) == ("0.0.0.0", bootstrap_service["spec"]["ports"][0]["port"])
    assert (router.host, router.bootstrap_url) == ("0.0.0.0", bootstrap_url)
    assert router.api_key is None and bootstrap.token is None


def test_notes_tell_how_to_reach_ready_and_scale(chart):
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["pdcluster/templates/NOTES.txt"]
    assert "/ready" in notes and "/metrics" in notes
    assert f"scale deployment/{PREFIX}-prefill" in notes and f"scale deployment/{PREFIX}-decode" in notes
