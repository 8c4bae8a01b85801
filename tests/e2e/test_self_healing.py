"""The cluster heals itself: a crashed worker is restarted by the local cluster's supervisor and taken back by the
router with no human action; a hung one (SIGSTOP of its whole process tree) is out of rotation within 10 s, the
request it held ends with a clear error, the other decode serves, and SIGCONT brings it back.

Runs after the other e2e tests (tests/conftest.py): it kills and stops workers of the shared cluster (and leaves them
all serving).
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import psutil

from tests.e2e.reference import assert_matches
from tests.helpers import CLUSTER_POLL, serving, until, used_tokens, worker_id, worker_url

GREEDY = {"sampling_params": {"max_new_tokens": 8, "temperature": 0}}
LONG_STREAM = {"text": "Tell me a long story", "stream": True,
               "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
HUNG_WITHIN = 10.0  # seconds: a hung worker is out of rotation, and the request it held has ended


def all_healthy(router: httpx.Client) -> bool:
    try:
        workers = router.get("/ready", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return len(workers) == 4 and all(not w["unusable"] for w in workers)


def healthy(router: httpx.Client, url: str) -> bool | None:
    row = next((w for w in router.get("/ready", timeout=5).json()["workers"] if w["url"].rstrip("/") == url), None)
    return None if row is None else row["healthy"]


def name_of(cluster, worker_id: str) -> str:
    role, port = worker_id.split("-")[0], int(worker_id.rsplit("-", 1)[1])
    first = cluster.spec.prefill.first_port if role == "prefill" else cluster.spec.decode.first_port
    return f"{role}-{port - first}"


def test_kill_9_of_a_prefills_sglang_is_healed_with_no_human_action(cluster, router, reference):
    assert cluster.supervising
    process = cluster.processes["prefill-1"]
    launcher, restarts = process.popen.pid, process.restarts
    sglang = next(p for p in psutil.Process(launcher).children() if "sglang" in " ".join(p.cmdline()))
    sglang.send_signal(signal.SIGKILL)  # SGLang crashes; its launcher exits 137; nobody asked for any of it
    assert until(lambda: process.restarts == restarts + 1, 30, CLUSTER_POLL), "the supervisor did not restart it"
    assert process.popen.pid != launcher
    # SGLang starts again (~30 s on an idle 2-core machine), registers, and the router takes it back.
    assert until(lambda: all_healthy(router), timeout=400, interval=1.0), router.get("/ready").json()
    text = "The restarted prefill answers"
    want = reference.greedy(text, 8)
    served = set()
    for _ in range(6):  # round robin: the restarted prefill gets its share
        response = router.post("/generate", json={"text": text, **GREEDY})
        assert response.status_code == 200, response.text
        assert_matches(response.json()["output_ids"], want, reference.eos)
        served.add(response.headers["x-pdcluster-prefill"])
    assert f"prefill-127.0.0.1-{cluster.spec.prefill.first_port + 1}" in served


def test_sigstop_of_a_decodes_tree_is_detected_within_10s_and_sigcont_readmits_it(cluster, router):
    assert until(lambda: all_healthy(router), timeout=60, interval=CLUSTER_POLL)
    baseline = used_tokens(worker_url(cluster, "decode-0"))
    # A long stream, on decode-0 (round robin: a few tries at most).
    for _ in range(4):
        response = router.send(router.build_request("POST", "/generate", json=LONG_STREAM,
                                                    timeout=httpx.Timeout(60)), stream=True)
        if name_of(cluster, response.headers["x-pdcluster-decode"]) == "decode-0":
            break
        response.close()
    else:
        raise AssertionError("no stream landed on decode-0")
    victim = worker_url(cluster, "decode-0")
    try:
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data:")) for _ in range(3)]
        tree = [psutil.Process(cluster.processes["decode-0"].popen.pid)]
        tree += tree[0].children(recursive=True)
        stopped_at = time.monotonic()
        for p in tree:
            p.suspend()  # the whole tree, launcher included: no heartbeats, no HTTP, no scheduler
        try:
            events += [line for line in lines if line.startswith("data:")]
            ended_after = time.monotonic() - stopped_at
            assert until(lambda: healthy(router, victim) is not True, timeout=HUNG_WITHIN, interval=CLUSTER_POLL)
            detected_after = time.monotonic() - stopped_at
            # The other decode serves meanwhile.
            for i in range(4):
                answer = router.post("/generate", json={"text": f"served elsewhere {i}", **GREEDY})
                assert answer.status_code == 200, answer.text
                assert name_of(cluster, answer.headers["x-pdcluster-decode"]) == "decode-1"
        finally:
            for p in tree:
                p.resume()
        resumed_at = time.monotonic()
    finally:
        response.close()
    assert ended_after < HUNG_WITHIN and detected_after < HUNG_WITHIN
    assert events[-1] != "data: [DONE]", "the stream ended as if nothing happened"
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] in (502, 503, 504) and "decode" in error["message"]
    # SIGCONT: back in rotation (heartbeats resume, the registry and the liveness probe take it back, and, if the
    # registry had dropped it meanwhile, its admission canary passes).
    assert until(lambda: serving(router, worker_id(cluster, "decode-0")), 20, CLUSTER_POLL), router.get("/ready").json()
    readmitted_after = time.monotonic() - resumed_at
    assert readmitted_after < 20
    decodes = {name_of(cluster, router.post("/generate", json={"text": f"both {i}", **GREEDY})
                       .headers["x-pdcluster-decode"]) for i in range(4)}
    assert decodes == {"decode-0", "decode-1"}
    # The abandoned stream's KV is freed once SGLang sees its client gone (no slot leaks through a hang).
    assert until(lambda: used_tokens(victim) == baseline, timeout=30, interval=CLUSTER_POLL), used_tokens(victim)
    assert all_healthy(router)
