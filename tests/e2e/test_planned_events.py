"""Planned events lose nothing: a rolling restart of every worker under load, a router stopped mid-stream and one
killed, a worker drained on demand, and a worker that comes back with other weights under the same path.

Under a steady load of streamed and plain requests, every answer is judged: its status, the whole number of tokens
asked for, no error event. tests/conftest.py runs it after the other end-to-end files (it restarts the shared
cluster's parts).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import httpx

from pdcluster.local.models import DEMO_ARGS
from tests.e2e.conftest import REPO
from tests.e2e.load import Load
from tests.helpers import CLUSTER_POLL, listing, serving, until, worker_id
from tests.unit.test_router_pd import metric


def test_a_rolling_restart_under_load_loses_no_request(cluster, router):
    """A worker's launcher gets SIGTERM (it deregisters at once, SGLang drains what it has) and is started again at
    the same host and ports, and the router serves it again (admitted anew). One of each role, both at once, as the
    chart's prefill and decode Deployments roll side by side (one pod of each unavailable at a time): the other
    prefill and decode carry the load meanwhile. The other two would take the same path (and minutes of `make
    test`)."""
    names = ("prefill-0", "decode-1")
    with Load(cluster.router_url) as load:
        for name in names:
            cluster.processes[name].signal(signal.SIGTERM)
        for name in names:
            cluster.processes[name].popen.wait(timeout=120)
            cluster.processes[name].start()
        for name in names:
            wid = worker_id(cluster, name)
            assert until(lambda wid=wid: serving(router, wid), 450, CLUSTER_POLL), router.get("/ready").json()
        answered_during = load.answers
    assert load.problems == [], load.problems[:5]
    assert answered_during >= 10


def test_a_router_stopped_mid_stream_finishes_it_and_a_restarted_one_serves_from_its_first_request(cluster):
    process = cluster.processes["router"]
    body = {"text": "A long one", "stream": True,
            "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
    try:
        with httpx.Client(base_url=cluster.router_url, timeout=120) as client, client.stream(
                "POST", "/generate", json=body) as response:
            lines = response.iter_lines()
            events = [next(line for line in lines if line.startswith("data:"))]
            process.signal(signal.SIGTERM)  # uvicorn takes no new connection and lets this stream finish
            events += [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["meta_info"]["completion_tokens"] == 300
        # A clean stop: uvicorn shuts down, then re-raises the signal it stopped on (so its parent sees why).
        assert process.popen.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Application shutdown complete." in process.tail(5)
        for stop in (None, signal.SIGKILL):  # started again after a clean stop, then after being killed
            if stop is not None:
                process.signal(stop)
                process.popen.wait(timeout=30)
            process.start()
            assert until(lambda: _connects(cluster.router_url), 60, CLUSTER_POLL)
            answers = [httpx.post(f"{cluster.router_url}/generate", timeout=60, json={
                "text": "first", "sampling_params": {"max_new_tokens": 4}}) for _ in range(4)]
            assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    finally:  # the later tests share this router
        if not process.running:
            process.start()
            until(lambda: _connects(cluster.router_url), 60, CLUSTER_POLL)


def _connects(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.HTTPError:
        return False
    return True


def test_a_worker_drained_on_demand_gets_nothing_new_and_comes_back_on_resume(cluster, router):
    wid = worker_id(cluster, "decode-0")
    bootstrap = [sys.executable, "-m", "bootstrap", "--url", cluster.spec.bootstrap_url]
    subprocess.run([*bootstrap, "drain", wid], check=True, cwd=REPO, timeout=60)
    assert until(lambda: not serving(router, wid), 10, CLUSTER_POLL)
    assert next(w for w in listing(cluster) if w["registration"]["worker_id"] == wid)["draining"]
    served = {router.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).headers[
        "x-pdcluster-decode"] for _ in range(8)}
    assert wid not in served
    subprocess.run([*bootstrap, "resume", wid], check=True, cwd=REPO, timeout=60)
    assert until(lambda: serving(router, wid), 10, CLUSTER_POLL)


def test_a_worker_with_other_weights_under_the_same_path_is_kept_out(cluster, router, tmp_path):
    """Another decode whose models/tiny-llama holds other weights: same model path, name, page size and KV dtype as
    the others, so only what it answers can tell. Its admission canary is refused, and it never serves."""
    other = tmp_path / "models" / "tiny-llama"
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo_model.py"), "--out", str(other), "--seed", "7"],
                   check=True, cwd=REPO, timeout=300)
    port = cluster.spec.decode.first_port + 50
    wid = f"decode-127.0.0.1-{port}"
    before = metric(cluster.router_url, "pdcluster_router_admissions_total", role="decode", result="refused")
    log = open(tmp_path / "impostor.log", "wb")  # noqa: SIM115 - the child keeps it
    impostor = subprocess.Popen([sys.executable, "-m", "decode", "--config", str(REPO / "configs" / "decode.yaml"),
                                 *DEMO_ARGS, "--cluster", f"bootstrap_url={cluster.spec.bootstrap_url}",
                                 "--port", str(port)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        def admission() -> str:
            return next((w["admission"] for w in router.get("/ready").json()["workers"] if w["worker_id"] == wid), "")
        assert until(lambda: admission() == "refused", 300, CLUSTER_POLL), \
            (tmp_path / "impostor.log").read_text()[-2000:]
        assert metric(cluster.router_url, "pdcluster_router_admissions_total", role="decode",
                      result="refused") == before + 1
        served = {router.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).headers[
            "x-pdcluster-decode"] for _ in range(8)}
        assert wid not in served
    finally:
        impostor.send_signal(signal.SIGTERM)
        impostor.wait(timeout=90)
        log.close()
        shutil.rmtree(other, ignore_errors=True)
    assert until(lambda: wid not in {w["worker_id"] for w in router.get("/ready").json()["workers"]}, 30, CLUSTER_POLL)
