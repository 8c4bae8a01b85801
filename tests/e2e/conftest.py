"""One real cluster for the whole end-to-end run: bootstrap service, SGLang prefill and decode, router.

It starts through pdcluster.local, the same launcher as `make up`, on ports of its own. If it cannot start, every
end-to-end test errors (never skips): CI must not go green on a cluster that does not run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdcluster.local import REPO, ComponentSpec, LocalCluster, LocalSpec, WorkerGroupSpec
from tests.e2e.reference import ReferenceModel

MODEL_DIR = REPO / "models" / "tiny-llama"


def e2e_spec() -> LocalSpec:
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=18998),
        router=ComponentSpec(config="configs/router.yaml", port=18000),
        prefill=WorkerGroupSpec(config="configs/prefill.yaml", count=1, first_port=31100,
                                first_kv_bootstrap_port=19000),
        decode=WorkerGroupSpec(config="configs/decode.yaml", count=1, first_port=31200),
        ready_timeout=600,
    )


@pytest.fixture(scope="session")
def demo_model() -> Path:
    subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(MODEL_DIR)], cwd=REPO, check=True)
    return MODEL_DIR


@pytest.fixture(scope="session")
def cluster(demo_model, tmp_path_factory) -> LocalCluster:
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    local = LocalCluster(e2e_spec(), log_dir)
    local.start()
    try:
        local.wait_ready()
    except Exception:
        local.stop()
        for process in local.processes.values():
            print(f"----- {process.name} -----\n{process.tail(40)}", file=sys.stderr)
        raise
    yield local
    local.stop()


@pytest.fixture(scope="session")
def router(cluster) -> httpx.Client:
    with httpx.Client(base_url=cluster.router_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def reference(demo_model) -> ReferenceModel:
    return ReferenceModel(str(demo_model))
