"""Admission by predicted wait on the shared cluster (router/pd/gate.py): a second router with admission on, over
prefill-0 and decode-0, each through a proxy (tests/e2e/fault_proxy.py) that counts the requests reaching the worker
and can hold the prefill's (a prefill slow to start: its prompt stays booked on the router's queue for it). A request
whose predicted wait is over the bound gets a 429 with Retry-After at once, read by the openai client, and no worker
sees it."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from router.checks.validation import check_generate
from tests.e2e.conftest import REPO
from tests.e2e.fault_proxy import FaultProxy, Faults
from tests.helpers import CLUSTER_POLL, free_port, until, worker_url

RATE = 10  # tokens/s: the second router's start rate of an unmeasured prefill
BOUND = 1.0  # seconds: its bound on a request's predicted wait


@pytest.fixture(scope="module")
def shedding(cluster, tmp_path_factory):
    work, held, counted = tmp_path_factory.mktemp("shedding"), Faults(), Faults()
    with FaultProxy(worker_url(cluster, "prefill-0"), held) as p0, \
            FaultProxy(worker_url(cluster, "decode-0"), counted) as d0, (work / "router.log").open("w") as log:
        port = free_port()
        (work / "router.yaml").write_text(yaml.safe_dump({
            "host": "127.0.0.1", "port": port, "bootstrap_url": None, "log_level": "info", "admission_check": False,
            "prefill": [{"url": p0.url, "kv_bootstrap_port": cluster.spec.prefill.first_kv_bootstrap_port}],
            "decode": [{"url": d0.url}],
            "admission": {"enabled": True, "unmeasured_tokens_per_s": RATE,
                          "classes": {"default": {"max_predicted_wait": BOUND, "queue_wait": 0}}}}))
        process = subprocess.Popen([sys.executable, "-m", "router", "--config", str(work / "router.yaml")], cwd=REPO,
                                   stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            assert until(lambda: _ready(url), 120, CLUSTER_POLL), (work / "router.log").read_text()[-3000:]
            yield url, held, counted
        finally:
            held.passing.set()
            process.terminate()
            process.wait(30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_request_over_the_predicted_wait_gets_a_429_before_any_worker_sees_it(shedding):
    url, held, counted = shedding
    long_body = {"text": "The router sheds load early. " * 14, "sampling_params": {"max_new_tokens": 4}}
    booked = check_generate(long_body).prompt_tokens  # what the router books for it on prefill-0's queue
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    held.passing.clear()
    try:
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(httpx.post, f"{url}/generate", json=long_body, timeout=120)
            assert until(lambda: held.generates == 1, 30, 0.01), long.result() if long.done() else "not sent"
            started = time.monotonic()
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(model="tiny-llama", prompt="hi", max_tokens=4)
            took = time.monotonic() - started
            held.passing.set()
            assert long.result().status_code == 200
    finally:
        held.passing.set()
    assert took < 1.0
    response = refused.value.response
    assert response.status_code == 429
    assert response.headers["retry-after"] == str(math.ceil(booked / RATE - BOUND))
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", 429)
    assert f"would wait {booked / RATE:.1f}s" in error["message"]
    assert (held.generates, counted.generates) == (1, 1)  # the long request's halves only
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'pdcluster_router_admission_refusals_total{class="default",reason="predicted_wait"} 1.0' in metrics
