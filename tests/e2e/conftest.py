"""One real cluster for the whole end-to-end run: bootstrap service, 2 SGLang prefills, 2 decodes, router, on the
demo model (configs/prefill.yaml and decode.yaml with pdcluster.local.models.DEMO_ARGS: milliseconds per request).

It starts through pdcluster.local, the same launcher as `make up`, on ports of its own. If it cannot start, every
end-to-end test errors (never skips): CI must not go green on a cluster that does not run. Every component traces,
to an OTLP receiver in this process (otlp_receiver; tests/e2e/test_tracing.py reads it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from bench.harness.otlp_receiver import Receiver
from pdcluster.local.cluster import LocalCluster, hold_pid
from pdcluster.local.models import DEMO_ARGS
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from tests.e2e.reference import ReferenceModel
from tests.helpers import CLUSTER_POLL, start_cluster, until, worker_url

# The cluster's relative paths are relative to the working directory: the tests run from the checkout's root.
REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "tiny-llama"


def e2e_spec() -> LocalSpec:
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=18998),
        router=ComponentSpec(config="tests/e2e/router.yaml", port=18000),
        # --enable-metrics: SGLang's /metrics, which tests/e2e/test_prometheus.py scrapes (as the chart does)
        prefill=WorkerGroupSpec(config="configs/prefill.yaml", args=[*DEMO_ARGS, "--enable-metrics"], count=2,
                                first_port=31100, first_kv_bootstrap_port=19000, first_kv_events_port=19100),
        decode=WorkerGroupSpec(config="configs/decode.yaml", args=[*DEMO_ARGS, "--enable-metrics"], count=2,
                               first_port=31200),
        ready_timeout=600,
    )


@pytest.fixture(scope="session")
def demo_model() -> Path:
    subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(MODEL_DIR)], cwd=REPO, check=True)
    return MODEL_DIR


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[Receiver]:
    """The collector the whole cluster traces to (tests/e2e/test_tracing.py reads it), up before the cluster: every
    component it starts (and any a test starts) inherits PDCLUSTER_TRACING=1 and the OTLP/HTTP endpoint. It keeps no
    span unless a test asks (`keep`); the OTEL_* variables of the shell running the tests are left out."""
    with Receiver(keep=False) as receiver, pytest.MonkeyPatch.context() as env:
        for name in [name for name in os.environ if name.startswith("OTEL_")]:
            env.delenv(name)
        env.setenv("PDCLUSTER_TRACING", "1")
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "1000")  # the routers' batches: each second (SGLang's: 500 ms)
        yield receiver


@pytest.fixture(scope="session")
def cluster(demo_model, otlp_receiver, tmp_path_factory) -> LocalCluster:
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    local = LocalCluster(e2e_spec(), log_dir)
    start_cluster(local)
    # A component that dies on its own is restarted, as under `make up` (tests/e2e/test_self_healing.py).
    local.supervise()
    yield local
    local.stop()


WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
# Modules that may leave the shared cluster hurt: they run last (tests/conftest.py), nothing runs on it after them.
LEFT_HURT = {"test_worker_failure"}
AT_REST = (0, 0, 0)  # requests running, requests waiting, KV tokens in use


def _work_held(cluster) -> dict[str, tuple[int, int, int]]:
    """Per worker: (requests running, requests waiting, KV tokens in use), asked of SGLang's scheduler."""
    held = {}
    for name in WORKERS:
        loads = httpx.get(f"{worker_url(cluster, name)}/v1/loads", params={"include": "core"}, timeout=10).json()
        held[name] = tuple(sum(load[key] for load in loads["loads"])
                           for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens"))
    return held


@pytest.fixture(scope="module", autouse=True)
def left_clean(request, cluster):
    """The modules share one cluster: each must leave it as it found it, so that none inherits another's requests,
    KV or ejected workers. After a module: every worker listed and served by the router (healthy, admitted, not
    draining), and no request running or waiting on any worker, nor any KV in use (a leaked request holds its KV; a
    finished one's cached prefix is evictable, which SGLang does not count as used). Waits a little for what a
    module's last request frees as it ends. (A baseline taken at the start would be wrong: the admission canaries may
    still be running then.)"""
    yield
    if request.module.__name__.rsplit(".", 1)[-1] in LEFT_HURT:
        return
    module = request.module.__name__

    def clean() -> bool:
        workers = httpx.get(f"{cluster.router_url}/ready", timeout=10).json()["workers"]
        return len(workers) == len(WORKERS) and not any(w["unusable"] for w in workers) and \
            set(_work_held(cluster).values()) == {AT_REST}

    if not until(clean, 60, CLUSTER_POLL):
        workers = httpx.get(f"{cluster.router_url}/ready", timeout=10).json()["workers"]
        pytest.fail(f"{module} left the shared cluster unclean: (running, waiting, KV tokens) per worker "
                    f"{_work_held(cluster)}, at rest {AT_REST}; router's workers {workers}")


@pytest.fixture(scope="session")
def router(cluster) -> httpx.Client:
    with httpx.Client(base_url=cluster.router_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def reference(demo_model) -> ReferenceModel:
    return ReferenceModel(str(demo_model))


def kill_tree(pid: int, sig: int = signal.SIGKILL, include_root: bool = True) -> None:
    """Kill a launcher's process tree on purpose: the cluster's supervisor leaves that component down until
    restart() (or Process.start) starts it again."""
    hold_pid(pid)
    root = psutil.Process(pid)
    for process in [*root.children(recursive=True), *([root] if include_root else [])]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)



def restart(cluster, names: list[str], router) -> None:
    for name in names:
        process = cluster.processes[name]
        if process.running:
            kill_tree(process.popen.pid)
            process.popen.wait(timeout=30)
        process.start()
    want = len(cluster.processes) - 2  # every worker
    assert until(lambda: sum(not w["unusable"] for w in router.get("/ready").json()["workers"]) == want, 300,
                 CLUSTER_POLL), (
        router.get("/ready").json())
