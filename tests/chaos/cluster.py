"""tests.chaos: the cluster under test (2 prefills, 2 decodes on ports of their own, on the demo model), the limits
each fault must meet, and how the run asks the cluster whether every worker serves."""

from __future__ import annotations

import httpx
import psutil

from pdcluster.local.cluster import LocalCluster
from pdcluster.local.models import DEMO_ARGS
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from tests.helpers import listing

MAX_NEW = 32
DEADLINE = 60.0  # no request may take longer, whatever happens to the cluster
SIZES = {"tiny": 5, "short": 40, "medium": 200, "long": 700, "longest": 1800}
HANG_SECONDS = 15.0
DETECT_LIMIT = 10.0  # a hung or dead worker is out of rotation within this many seconds
LIMITS = {  # seconds from the injection (from SIGCONT for a hang) until every worker serves again
    "hang": 20.0,  # from SIGCONT
    "stall": 20.0,
    "kill": 300.0,  # SGLang takes ~30 s to start on an idle 2-core machine, minutes on a busy one
    "bootstrap": 15.0,
    "router": 60.0,
    "network": 30.0,
}
ALL_FAULTS = ["hang decode-0", "hang prefill-0", "stall decode-1", "kill decode-1", "kill prefill-1",
              "restart bootstrap", "restart router"]


def chaos_spec(base: int, kv_base: int) -> LocalSpec:
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=base + 998),
        router=ComponentSpec(config="tests/e2e/router.yaml", port=base),  # names the pair on every answer
        prefill=WorkerGroupSpec(config="configs/prefill.yaml", args=DEMO_ARGS, count=2, first_port=base + 100,
                                first_kv_bootstrap_port=kv_base),
        decode=WorkerGroupSpec(config="configs/decode.yaml", args=DEMO_ARGS, count=2, first_port=base + 200),
        ready_timeout=900,
    )


def sglang_main(cluster: LocalCluster, name: str) -> psutil.Process | None:
    """The SGLang server process a worker's launcher runs (its direct child)."""
    try:
        children = psutil.Process(cluster.processes[name].popen.pid).children()
    except psutil.NoSuchProcess:
        return None
    return next((c for c in children if "sglang" in " ".join(c.cmdline())), None)


def ready(router_url: str) -> dict | None:
    try:
        return httpx.get(f"{router_url}/ready", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None


def worker_healthy(router_url: str, url: str) -> bool | None:
    """True/False as the router sees the worker; None if the router does not list it (or does not answer)."""
    state = ready(router_url)
    if state is None:
        return None
    row = next((w for w in state["workers"] if w["url"].rstrip("/") == url), None)
    return None if row is None else row["healthy"]


def all_serving(cluster: LocalCluster) -> bool:
    state = ready(cluster.router_url)
    want = cluster.spec.prefill.count + cluster.spec.decode.count
    return state is not None and sum(not w["unusable"] for w in state["workers"]) >= want


def registered(cluster: LocalCluster) -> int:
    try:
        return len(listing(cluster))
    except (httpx.HTTPError, ValueError, KeyError):
        return -1
