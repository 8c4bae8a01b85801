"""Long prompts of a real model must not look like a hang (router/fleet/liveness.py), whichever router sent them.

On 2 CPU cores one SmolLM2 prefill forward pass of a 2000-4000-token prompt takes 10-30 s in silence: no token, no
load snapshot, SGLang's /health waiting. Before the allowance for a forward pass, the router ejected such a prefill
after stall_timeout (6 s) and ended every request it held (502s, then 503 'no healthy pair'). Routers that share the
workers (the chart runs two) cannot see each other's prompts: with the allowance counted from its own prompts only,
a router with nothing in flight on the prefill ejected it while the other router's long prompt ran (bench.cluster on
SmolLM2: 14 ejections of healthy prefills in 6 minutes). Here streams decode through the cluster's router while long
prompts arrive through it and through a second router over the same workers: every answer is whole, neither router
ejects anything, and the cluster ends healthy."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdcluster.local.process import Process
from tests.e2e_smollm2.conftest import BOOTSTRAP_PORT, healthy_workers
from tests.e2e_smollm2.traffic import long_prompt, stream_story
from tests.helpers import until

SECOND_ROUTER_PORT = 12001


@pytest.fixture
def second_router(cluster):
    """Another router over the same registry and workers, as a second replica of the chart's router."""
    process = Process("router-b", [sys.executable, "-m", "router", "--config", "configs/router.yaml", "--host",
                                   "127.0.0.1", "--port", str(SECOND_ROUTER_PORT), "--bootstrap-url",
                                   f"http://127.0.0.1:{BOOTSTRAP_PORT}"], cluster.log_dir / "router-b.log")
    process.start()
    url = f"http://127.0.0.1:{SECOND_ROUTER_PORT}"
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            assert until(lambda: len(healthy_workers(client)) == 2, 300, 0.5), process.tail(40)
        yield url, process
    finally:
        process.signal(signal.SIGTERM)
        try:
            process.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.popen.kill()


def test_long_prompts_while_streams_decode_eject_nothing_and_fail_nothing(cluster, router, reference,
                                                                         second_router):
    other_url, other = second_router
    problems: list[str] = []

    def stream(i: int) -> None:
        if problem := stream_story(cluster.router_url, i, 48):
            problems.append(problem)

    def long(url: str, tokens: int) -> None:
        if problem := long_prompt(url, reference.tokenizer, tokens):
            problems.append(problem)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    # One after the other, each arriving while the streams and the others run: the cluster's router has the streams
    # and the 2000-token prompt; the 4000- and 3000-token ones come through the other router, so that the cluster's
    # router has nothing of its own on the prefill while they are computed.
    for url, tokens in ((cluster.router_url, 2000), (other_url, 4000), (other_url, 3000)):
        threads.append(threading.Thread(target=long, args=(url, tokens)))
        threads[-1].start()
        time.sleep(2)
    for thread in threads:
        thread.join(900)
    assert not any(thread.is_alive() for thread in threads), "a request never finished"
    assert not problems, problems  # both streams whole: 48 tokens each
    for log in (cluster.log_dir / "router.log", other.log_path):
        text = log.read_text()
        assert "worker hung" not in text, [line for line in text.splitlines() if "worker hung" in line]
    assert len(healthy_workers(router)) == 2
