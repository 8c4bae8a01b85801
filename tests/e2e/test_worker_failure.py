"""A dying worker fails only the requests it held, fast and visibly; the cluster goes on serving and recovers.

Runs last (tests/conftest.py): it kills and restarts workers of the shared cluster.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import psutil

from tests.e2e.conftest import kill_tree, restart
from tests.helpers import CLUSTER_POLL, listing, until, used_tokens, worker_url

LONG_STREAM = {"text": "Tell me a very long story", "stream": True,
               "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}


def schedulers(cluster, name: str) -> list[psutil.Process]:
    tree = psutil.Process(cluster.processes[name].popen.pid).children(recursive=True)
    return [p for p in tree if p.name().startswith("sglang::sched") or "scheduler" in " ".join(p.cmdline())]


def data_events(lines, limit: int | None = None) -> list[str]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line)
            if limit and len(events) == limit:
                break
    return events


def test_prefill_killed_mid_request_gives_an_error_within_5s_and_frees_the_decode_slot(cluster, router):
    decode_baselines = {n: used_tokens(worker_url(cluster, n)) for n in ("decode-0", "decode-1")}
    frozen = {name: schedulers(cluster, name) for name in ("prefill-0", "prefill-1")}
    for processes in frozen.values():
        for p in processes:
            p.suspend()  # the prefill accepts the request but never computes it: the decode waits with slots held
    try:
        with router.stream("POST", "/generate", json=LONG_STREAM, timeout=httpx.Timeout(30)) as response:
            assert response.status_code == 200
            victim = response.headers["x-pdcluster-prefill"].split("-")  # prefill-<host>-<port>
            name = f"prefill-{int(victim[-1]) - cluster.spec.prefill.first_port}"
            decode = response.headers["x-pdcluster-decode"]
            decode_name = f"decode-{int(decode.split('-')[-1]) - cluster.spec.decode.first_port}"
            time.sleep(1.0)
            assert used_tokens(worker_url(cluster, decode_name)) > decode_baselines[decode_name]
            killed_at = time.monotonic()
            kill_tree(cluster.processes[name].popen.pid)
            events = data_events(response.iter_lines())
            elapsed = time.monotonic() - killed_at
    finally:
        for processes in frozen.values():
            for p in processes:
                if p.is_running():
                    p.resume()
    assert elapsed < 5
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert "prefill" in error["message"] and error["code"] in (502, 503, 504)
    # Freed once SGLang gives up on the dead prefill's drain ack (configs/decode.yaml: 5 s), not after 300 s.
    assert until(lambda: used_tokens(worker_url(cluster, decode_name)) == decode_baselines[decode_name], 15,
                 CLUSTER_POLL)
    restart(cluster, [name], router)


def test_kill_9_of_a_decode_drops_it_from_the_listing_and_requests_keep_succeeding(cluster, router):
    victim = cluster.processes["decode-1"]
    kill_tree(victim.popen.pid)  # launcher included: no clean deregistration, only the TTL can tell
    ttl = 5.0  # configs/bootstrap.yaml
    assert until(lambda: len(listing(cluster, "decode")) == 1, timeout=ttl + 2, interval=CLUSTER_POLL)
    for i in range(6):
        response = router.post("/generate", json={"text": f"still serving {i}",
                                                   "sampling_params": {"max_new_tokens": 2}})
        assert response.status_code == 200, response.text
        assert response.headers["x-pdcluster-decode"].endswith(str(cluster.spec.decode.first_port))


def test_decode_killed_mid_stream_gives_an_error_within_10s_and_ready_turns_false(cluster, router):
    decode = cluster.processes["decode-0"]  # the last decode standing
    with router.stream("POST", "/generate", json=LONG_STREAM, timeout=httpx.Timeout(30)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events = data_events(lines, limit=3)
        killed_at = time.monotonic()
        kill_tree(decode.popen.pid, include_root=False)  # SGLang crashes; its launcher sees it
        events += data_events(lines)
        ended_after = time.monotonic() - killed_at
    assert ended_after < 10
    assert events[-1] != "data: [DONE]", "the stream ended as if nothing happened"
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] in (502, 503, 504) and "decode" in last["error"]["message"]
    assert until(lambda: router.get("/ready").status_code == 503, timeout=10, interval=CLUSTER_POLL)
    refused = router.post("/generate", json={"text": "hi"})
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "unavailable"
    decode.popen.wait(timeout=30)
    assert decode.popen.returncode == 128 + signal.SIGKILL  # the launcher exits with SGLang's status


def test_cluster_serves_again_once_the_decodes_are_back(cluster, router):
    restart(cluster, ["decode-0", "decode-1"], router)
    response = router.post("/generate", json={"text": "Back again", "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True}})  # sampled from a random model: it may end early otherwise
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 4


def test_sigterm_stops_a_worker_cleanly_with_no_orphans_and_deregisters_it(cluster, router):
    decode = cluster.processes["decode-1"]
    tree = psutil.Process(decode.popen.pid).children(recursive=True)
    assert tree, "the launcher should be supervising SGLang"
    decode.signal(signal.SIGTERM)
    # SGLang's own status: 0, or 137 when its shutdown kills a child first and it reads that as a crash (racy).
    assert decode.popen.wait(timeout=60) in (0, 128 + signal.SIGTERM, 128 + signal.SIGKILL)
    survivors = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert survivors == []
    assert [w["registration"]["worker_id"] for w in listing(cluster, "decode")] == [
        f"decode-127.0.0.1-{cluster.spec.decode.first_port}"]
