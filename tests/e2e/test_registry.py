"""Worker discovery on real processes: several workers, compatibility, and restarts without lost requests."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import httpx

from tests.e2e.reference import assert_matches
from tests.helpers import CLUSTER_POLL, listing, until, worker_url


def greedy(text: str, n: int = 6) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def test_requests_spread_over_every_prefill_and_decode_with_correct_tokens(router, reference):
    served = Counter()
    for i in range(8):
        text = f"Spread request {i} about rivers and bread"
        response = router.post("/generate", json=greedy(text))
        assert response.status_code == 200, response.text
        assert_matches(response.json()["output_ids"], reference.greedy(text, 6), reference.eos)
        served[response.headers["x-pdcluster-prefill"]] += 1
        served[response.headers["x-pdcluster-decode"]] += 1
    assert len(served) == 4 and all(count >= 2 for count in served.values()), served


def test_a_worker_launcher_only_supervises_and_keeps_little_memory(cluster):
    """Deciding a plan imports SGLang's argument parser and torch (~0.8 GB); the launcher then execs itself into a
    fresh interpreter that supervises with the plan alone: same pid (signals, exit statuses), its command line
    kept after `--as`."""
    import psutil

    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        launcher = psutil.Process(cluster.processes[name].popen.pid)
        cmdline = launcher.cmdline()
        assert cmdline[1:4] == ["-m", "pdcluster.worker.cli", "--as"] and "--config" in cmdline, cmdline
        assert launcher.memory_info().rss < 200 * 2**20, (name, launcher.memory_info().rss)
        assert "sglang.launch_server" in " ".join(launcher.children()[0].cmdline())


def test_workers_register_what_they_serve(cluster):
    rows = {w["registration"]["worker_id"]: w for w in listing(cluster)}
    prefills = [w for w in rows.values() if w["registration"]["role"] == "prefill"]
    assert len(prefills) == 2 and len(rows) == 4
    assert sorted(p["registration"]["kv_bootstrap_port"] for p in prefills) == [19000, 19001]
    for row in rows.values():
        identity = row["registration"]["identity"]
        assert identity["served_model_name"] == "tiny-llama" and identity["transfer_backend"] == "mooncake_tcp"
        assert row["healthy"] and row["incompatible"] == ""


def test_status_command_prints_the_registry(cluster):
    result = subprocess.run([sys.executable, "-m", "bootstrap", "status", "--url", cluster.spec.bootstrap_url],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ROLE", "WORKER", "URL", "MODEL", "HEALTH", "AGE", "NOTE"]
    assert sum("healthy" in line.split() for line in lines) == 4


def test_a_decode_with_another_page_size_is_listed_with_the_reason_and_never_paired(cluster, router):
    # Registered by hand at a real decode's URL (so it passes health checks): only its identity is wrong.
    odd = next(w for w in listing(cluster, "decode"))["registration"]
    odd = {**odd, "worker_id": "odd-decode", "identity": {**odd["identity"], "page_size": 16}}
    assert httpx.put(f"{cluster.spec.bootstrap_url}/v1/workers/odd-decode", json=odd).status_code == 200
    try:
        row = next(w for w in listing(cluster) if w["registration"]["worker_id"] == "odd-decode")
        assert "page_size 16 vs 1" in row["incompatible"]
        assert until(lambda: any(w["worker_id"] == "odd-decode" for w in router.get("/ready").json()["workers"]), 5,
                     CLUSTER_POLL)
        decodes = {router.post("/generate", json=greedy(f"pairing {i}", 2)).headers["x-pdcluster-decode"]
                   for i in range(6)}
        assert "odd-decode" not in decodes and len(decodes) == 2
    finally:
        httpx.delete(f"{cluster.spec.bootstrap_url}/v1/workers/odd-decode")


def test_restarted_router_serves_its_first_request_on_a_discovered_pair(cluster, router):
    process = cluster.processes["router"]
    process.signal(15)
    process.popen.wait(timeout=30)
    process.start()
    assert until(lambda: _ready(cluster.router_url), timeout=60, interval=CLUSTER_POLL)
    response = httpx.post(f"{cluster.router_url}/generate", json=greedy("First after restart"), timeout=120)
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 6


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_bootstrap_service_restart_under_load_loses_no_request(cluster, router):
    failures, done, stop = [], [], threading.Event()

    def load() -> None:
        with httpx.Client(base_url=cluster.router_url, timeout=120) as client:
            i = 0
            while not stop.is_set():
                response = client.post("/generate", json=greedy(f"load {i}", 4))
                (done if response.status_code == 200 else failures).append(response.status_code)
                i += 1

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    service = cluster.processes["bootstrap"]
    service.signal(15)
    service.popen.wait(timeout=30)
    service.start()
    assert until(lambda: _listing_size(cluster) >= 0, timeout=30, interval=CLUSTER_POLL)
    restarted = time.monotonic()
    assert until(lambda: _listing_size(cluster) == 4, timeout=10, interval=CLUSTER_POLL)
    refilled_after = time.monotonic() - restarted
    until(lambda: len(done) > 10, timeout=60, interval=CLUSTER_POLL)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == [] and len(done) > 10
    assert refilled_after < 2.5  # one heartbeat (1 s) plus scheduling slack on a busy 2-core machine


def _listing_size(cluster) -> int:
    try:
        return len(listing(cluster))
    except httpx.HTTPError:
        return -1


def test_worker_url_helper_matches_the_listing(cluster):
    urls = {w["registration"]["url"].rstrip("/") for w in listing(cluster)}
    assert {worker_url(cluster, n) for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")} == urls
