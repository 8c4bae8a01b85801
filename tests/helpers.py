"""The tests' helpers, in one place: a free port, waiting for a condition, and what the suites on a local cluster
(pdcluster.local: tests/e2e*, tests/chaos) ask it. The hermetic fake worker is tests/fakes.py; each suite's
conftest.py has what only that suite needs.

free_port is bench/'s (bench.harness.procs): the tests may import from bench/ (they test its code and start its
decode-only worker), bench/ never from tests/, so what both need lives on that side.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import httpx
import psutil

from bench.harness.procs import free_port

__all__ = ["free_port", "give_up", "listing", "seconds_until", "serving", "start_cluster", "until", "used_tokens",
           "worker_id", "worker_url"]

# How often to ask a real cluster (HTTP to a router or a scheduler): more often would load the 2 cores it runs on.
CLUSTER_POLL = 0.2


def seconds_until(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> float | None:
    """Poll `predicate` until it holds: the seconds that took, or None if it did not within `timeout`."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return time.monotonic() - began
        time.sleep(interval)
    return None


def until(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.02) -> bool:
    """Whether `predicate` held within `timeout` seconds (generous timeouts: the machine may be busy). The default
    interval suits in-process fakes; a real cluster is polled every CLUSTER_POLL."""
    return seconds_until(predicate, timeout, interval) is not None


def used_tokens(worker_url: str) -> int:
    """SGLang's live KV usage (asked of the scheduler, not a cached metric)."""
    loads = httpx.get(f"{worker_url}/v1/loads", params={"include": "core"}, timeout=10).json()["loads"]
    return sum(load["num_used_tokens"] for load in loads)


def listing(cluster, role: str | None = None) -> list[dict]:
    params = {"role": role} if role else {}
    return httpx.get(f"{cluster.spec.bootstrap_url}/v1/workers", params=params, timeout=5).json()["workers"]


def worker_url(cluster, name: str) -> str:
    group, index = name.split("-")
    spec = cluster.spec.prefill if group == "prefill" else cluster.spec.decode
    return f"http://127.0.0.1:{spec.first_port + int(index)}"


def worker_id(cluster, name: str) -> str:
    """The id a local cluster's worker `name` ("prefill-0", "decode-1", ...) registers under."""
    group, index = name.split("-")
    spec = cluster.spec.prefill if group == "prefill" else cluster.spec.decode
    return f"{group}-127.0.0.1-{spec.first_port + int(index)}"


def serving(router: httpx.Client, wid: str) -> bool:
    """Whether the router sends new requests to worker `wid`: listed, healthy, admitted (a worker that registers
    anew passes its admission canary first), not draining, its breaker closed."""
    workers = {w["worker_id"]: w for w in router.get("/ready", timeout=5).json()["workers"]}
    return wid in workers and not workers[wid]["unusable"]


def start_cluster(local) -> None:
    """Start a local cluster and wait until it serves; if it does not, give up on it, and raise."""
    local.start()
    try:
        local.wait_ready()
    except BaseException:  # an interrupt too
        give_up(local)
        raise


def give_up(local) -> None:
    """A local cluster that did not start: stop it (never leave one behind) and show each process's last log lines,
    the first place to look."""
    local.stop(timeout=60)
    for process in local.processes.values():
        print(f"----- {process.name} -----\n{process.tail(40)}", file=sys.stderr)


def assert_plugin_refuses(plugin, internals, monkeypatch, change: str) -> str:
    """An SGLang plugin of ours (pdcluster/plugins/sglang_plugin.py), turned on, whose adapted internal `change` is not
    what it was written for: register() stops the process naming SGLang's version and the change (SystemExit: SGLang's
    load_plugins() swallows an Exception), with nothing left patched. Returns the message."""
    import re

    import pytest
    import sglang

    monkeypatch.setenv(plugin.ENV_VAR, "1")
    with pytest.raises(SystemExit, match=rf"cannot adapt SGLang {re.escape(sglang.__version__)}: .*{change}") as exc:
        plugin.register()
    assert not isinstance(exc.value, Exception)
    assert not internals._undo
    return str(exc.value)


def sglang_processes(cluster) -> dict[str, set[int]]:
    """Each worker's SGLang processes (the launcher's children): a crashed scheduler changes them."""
    out = {}
    for name, process in cluster.processes.items():
        if name.startswith(("prefill", "decode")):
            out[name] = {p.pid for p in psutil.Process(process.popen.pid).children(recursive=True)}
    return out


# The router's own error event in a stream that a worker failed: its messages name one of these.
ROUTER_ERRORS = ("unreachable", "dropped the connection", "stopped answering", "no healthy pair", "answered 5")
