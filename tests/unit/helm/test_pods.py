"""What the pods get: GPUs, shared memory and probes, secrets, no API access and no privileges, RDMA, the KV cache's
volume, metrics scraping, and a roll when a config changes."""

from __future__ import annotations

import base64
import json

import pytest

from tests.unit.helm.chart import (
    NAMESPACE,
    PREFIX,
    WORKERS,
    by_kind,
    config_file,
    container,
    env_of,
    helm,
    kv_mount,
    matches,
    pod_spec,
    render,
    workloads,
)


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
            # SIGTERM: the launcher drains SGLang for the pod's grace period less STOP_MARGIN, which it is told.
            grace = pod_spec(workload)["terminationGracePeriodSeconds"]
            env = {e["name"]: e.get("value") for e in ctr["env"]}
            assert env["PDCLUSTER_GRACE_SECONDS"] == str(grace) and grace >= supervisor.STOP_MARGIN + 15
        for component in ("bootstrap", "router"):
            ctr = container(workloads(docs)[component])
            assert ctr["image"].endswith(":cpu") and "nvidia.com/gpu" not in ctr["resources"].get("limits", {})


def test_secrets_come_from_a_secret_never_from_a_configmap(chart):
    sentinels = {"token": "tok-3f9a-sentinel", "apiKey": "key-7c1e-sentinel", "hfToken": "hf-55d0-sentinel",
                 "kvSecret": "kv-91b2-sentinel"}
    docs = render(chart, {"secrets": sentinels})
    (secret,) = by_kind(docs, "Secret").values()
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == sentinels
    for doc in docs:
        if doc is not secret:
            text = json.dumps(doc)
            assert not any(s in text for s in sentinels.values()), f"{doc['kind']}/{doc['metadata']['name']}"
    found = workloads(docs)
    expected = {"bootstrap": {"PDCLUSTER_TOKEN": "token"}, "router": {"PDCLUSTER_API_KEY": "apiKey"},
                "prefill": {"PDCLUSTER_TOKEN": "token", "HF_TOKEN": "hfToken", "PDCLUSTER_KV_SECRET": "kvSecret"},
                "decode": {"PDCLUSTER_TOKEN": "token", "HF_TOKEN": "hfToken", "PDCLUSTER_KV_SECRET": "kvSecret"}}
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
            if name in ("bootstrap", "router", "planner"):
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
    with pytest.raises(helm.HelmError, match=r"rdma\.enabled needs rdma\.resources"):
        render(chart, {"rdma": {"enabled": True}})



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
