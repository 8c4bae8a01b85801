"""One real cluster for live role flips: bootstrap service, 2 prefills and 1 decode on the demo model (tiny-llama),
every worker switch-enabled (the launcher's default on Mooncake), and the router, started once for this directory
through pdcluster.local on ports of its own (21xxx). Package scope: gone before the next suite starts.

The fixtures are for every test of a flip (the planner's too): `flip_cluster`, `router`, `reference`, `switch` (the
CLI people use) and `ask_switch` (the HTTP call a planner makes). Each test leaves the cluster as it found it: the
same workers in the same roles, all serving (`as_found`, checked after every test).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pdcluster.local.cluster import LocalCluster
from pdcluster.local.models import DEMO_ARGS
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from tests.e2e.reference import ReferenceModel
from tests.helpers import CLUSTER_POLL, start_cluster, until, worker_id, worker_url

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "tiny-llama"
BOOTSTRAP_PORT, ROUTER_PORT = 21998, 21000
WORKERS = ("prefill-0", "prefill-1", "decode-0")


def flip_spec() -> LocalSpec:
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=BOOTSTRAP_PORT),
        router=ComponentSpec(config="tests/e2e/router.yaml", port=ROUTER_PORT),
        prefill=WorkerGroupSpec(config="configs/prefill.yaml", args=DEMO_ARGS, count=2, first_port=21100,
                                first_kv_bootstrap_port=21300, first_kv_events_port=21400),
        decode=WorkerGroupSpec(config="configs/decode.yaml", args=DEMO_ARGS, count=1, first_port=21200),
        ready_timeout=600,
    )


@pytest.fixture(scope="package")
def flip_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(MODEL_DIR)], cwd=REPO, check=True)
    local = LocalCluster(flip_spec(), tmp_path_factory.mktemp("flip-logs"))
    start_cluster(local)
    local.supervise()
    yield local
    local.stop()


@pytest.fixture(scope="package")
def router(flip_cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=flip_cluster.router_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="package")
def registry(flip_cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=flip_cluster.spec.bootstrap_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="package")
def reference() -> ReferenceModel:
    return ReferenceModel(str(MODEL_DIR))


@pytest.fixture(scope="package")
def ids(flip_cluster) -> dict[str, str]:
    """Each worker's registry id, by its local name ("prefill-1"); the id stays when its role changes."""
    return {name: worker_id(flip_cluster, name) for name in WORKERS}


def roles(registry: httpx.Client) -> dict[str, str]:
    return {w["registration"]["worker_id"]: w["registration"]["role"] for w in registry.get("/v1/workers").json()[
        "workers"]}


@pytest.fixture(scope="package")
def switch(flip_cluster) -> Callable[..., subprocess.CompletedProcess]:
    """`python -m bootstrap switch WORKER --to ROLE`, as an operator runs it."""

    def run(wid: str, to: str, wait: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bootstrap", "switch", wid, "--to", to, "--wait", str(wait),
                               "--url", flip_cluster.spec.bootstrap_url], cwd=REPO, capture_output=True, text=True,
                              timeout=wait + 30)

    return run


@pytest.fixture(scope="package")
def ask_switch(registry) -> Callable[[str, str], httpx.Response]:
    """The planner's call: POST /v1/workers/{id}/switch."""
    return lambda wid, to: registry.post(f"/v1/workers/{wid}/switch", json={"to": to})


def all_serving(router: httpx.Client, registry: httpx.Client, ids: dict[str, str]) -> bool:
    """The cluster as started: each worker in its first role, the router serving every one."""
    workers = {w["worker_id"]: w for w in router.get("/ready", timeout=10).json()["workers"]}
    started_as = {wid: name.split("-")[0] for name, wid in ids.items()}
    return roles(registry) == started_as and set(workers) == set(ids.values()) and \
        not any(w["unusable"] for w in workers.values())


def kv_in_use(cluster: LocalCluster) -> dict[str, int]:
    """Per worker, the KV tokens SGLang's scheduler holds (a finished request's cached prefix is not counted)."""
    return {name: sum(load["num_used_tokens"] for load in httpx.get(f"{worker_url(cluster, name)}/v1/loads", params={
        "include": "core"}, timeout=10).json()["loads"]) for name in WORKERS}


@pytest.fixture(autouse=True)
def as_found(flip_cluster, router, registry, ids):
    """Every test starts on, and leaves, the cluster as it was started (a flipped worker flipped back), with no KV
    held at rest: a flip leaks none."""
    assert until(lambda: all_serving(router, registry, ids), 120, CLUSTER_POLL), router.get("/ready").json()
    yield
    assert until(lambda: all_serving(router, registry, ids), 120, CLUSTER_POLL), (
        f"the test left the cluster changed: roles {roles(registry)}, router {router.get('/ready').json()}")
    assert until(lambda: set(kv_in_use(flip_cluster).values()) == {0}, 60, CLUSTER_POLL), kv_in_use(flip_cluster)
