"""A decode dying mid-stream fails only its requests, fast and visibly; the cluster recovers when it returns.

Named to run last: it kills and restarts a worker of the shared cluster.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import psutil


def kill_sglang_under(launcher_pid: int) -> None:
    """SIGKILL SGLang's processes under a worker launcher: what a crash of the server looks like."""
    for child in psutil.Process(launcher_pid).children(recursive=True):
        child.send_signal(signal.SIGKILL)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_decode_killed_mid_stream_gives_an_error_within_10s_and_ready_turns_false(cluster, router):
    decode = cluster.processes["decode-0"]
    body = {"text": "Tell me a very long story", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    events = []
    with router.stream("POST", "/generate", json=body, timeout=httpx.Timeout(30)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    break
        killed_at = time.monotonic()
        kill_sglang_under(decode.popen.pid)
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
        ended_after = time.monotonic() - killed_at
    assert ended_after < 10
    assert events[-1] != "data: [DONE]", f"stream ended normally after {len(events)} events: {events[-2][:300]}"
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] in (502, 503, 504) and "decode" in last["error"]["message"]
    assert wait_for(lambda: router.get("/ready").status_code == 503, timeout=10)
    assert router.post("/generate", json={"text": "hi"}).status_code == 503


def test_cluster_serves_again_once_the_decode_is_back(cluster, router):
    decode = cluster.processes["decode-0"]
    decode.popen.wait(timeout=30)  # its launcher noticed SGLang died and exited with its status
    assert decode.popen.returncode == 128 + signal.SIGKILL
    decode.start()
    assert wait_for(lambda: router.get("/ready").status_code == 200, timeout=300)
    response = router.post("/generate", json={"text": "Back again", "sampling_params": {"max_new_tokens": 4}})
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 4


def test_sigterm_stops_a_worker_cleanly_with_no_orphans_and_deregisters_it(cluster, router):
    decode = cluster.processes["decode-0"]
    tree = psutil.Process(decode.popen.pid).children(recursive=True)
    assert tree, "the launcher should be supervising SGLang"
    decode.signal(signal.SIGTERM)
    assert decode.popen.wait(timeout=60) in (0, 128 + signal.SIGTERM)
    survivors = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert survivors == []
    listing = httpx.get(f"{cluster.spec.bootstrap_url}/v1/workers", params={"role": "decode"}).json()
    assert listing["workers"] == []
