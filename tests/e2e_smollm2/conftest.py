"""One real cluster on SmolLM2-135M-Instruct, the model `make up` serves: bootstrap service, 1 prefill, 1 decode and
the router, started once for this directory through pdcluster.local with the shipped configs
(configs/prefill-persistent.yaml, decode-persistent.yaml, router.yaml), on ports of its own (12xxx) and with its KV
store in a temporary directory. Package scope: gone before the next suite of `make test` starts its cluster.

The model is the one `make setup` built (scripts/fetch_smollm2.py): nothing is downloaded here. If it is missing or
the cluster cannot start, every test errors; none is skipped. Prompts stay at a few hundred tokens: one prefill
forward must stay well within the router's stall_timeout on 2 busy cores.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
import pytest

from pdcluster.local.cluster import LocalCluster
from pdcluster.local.models import SMOLLM2
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from tests.e2e.reference import ReferenceModel
from tests.helpers import start_cluster, until

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / SMOLLM2
BOOTSTRAP_PORT, ROUTER_PORT, PREFILL_PORT, KV_BOOTSTRAP_PORT, DECODE_PORT = 12998, 12000, 12100, 12300, 12200
# Two SmolLM2 HiCache workers: ~3 GiB each (weights, a 16384-token pool and its host copy), and SGLang's HiCache
# wants 1 GiB free beyond its pool at each start (pdcluster/plugins/cpu_hicache).
NEEDED_GIB = 8


def spec(kv_dir) -> LocalSpec:
    kv = ["--cluster", f"kv_store.dir={kv_dir}"]
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=BOOTSTRAP_PORT),
        router=ComponentSpec(config="configs/router.yaml", port=ROUTER_PORT),
        prefill=WorkerGroupSpec(config="configs/prefill-persistent.yaml", args=kv, count=1, first_port=PREFILL_PORT,
                                first_kv_bootstrap_port=KV_BOOTSTRAP_PORT),
        decode=WorkerGroupSpec(config="configs/decode-persistent.yaml", args=kv, count=1, first_port=DECODE_PORT),
        ready_timeout=600,
    )


@pytest.fixture(scope="package")
def smollm2() -> str:
    assert (MODEL_DIR / "model.safetensors").is_file(), f"{MODEL_DIR} is missing: `make setup` builds it"
    return str(MODEL_DIR)


@pytest.fixture(scope="package")
def kv_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("smollm2-kv")


@pytest.fixture(scope="package")
def cluster(smollm2, kv_dir, tmp_path_factory) -> LocalCluster:
    # Another suite's workers may still be exiting; if the RAM never comes, SGLang's own refusal says so in the log.
    until(lambda: psutil.virtual_memory().available >= NEEDED_GIB * 2**30, 300, 1.0)
    local = LocalCluster(spec(kv_dir), tmp_path_factory.mktemp("smollm2-logs"))
    start_cluster(local)
    yield local
    local.stop(timeout=60)


@pytest.fixture(scope="package")
def router(cluster) -> httpx.Client:
    with httpx.Client(base_url=cluster.router_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="package")
def reference(smollm2) -> ReferenceModel:
    return ReferenceModel(smollm2)


def healthy_workers(router: httpx.Client) -> set[str]:
    """The workers the router serves with (healthy, in rotation, admitted)."""
    try:
        return {w["worker_id"] for w in router.get("/ready", timeout=5).json()["workers"] if not w["unusable"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return set()
