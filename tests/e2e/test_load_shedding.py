"""Load shedding on the shared cluster, each through a router of its own (the shared one stays as it is).

Admission by predicted wait (router/admission/gate.py): a router with admission on, over prefill-0 and decode-0, each
through a proxy (tests/e2e/fault_proxy.py) that counts the requests reaching the worker and can hold the prefill's (a
prefill slow to start: its prompt stays booked on the router's queue for it). A request whose predicted wait is over
the bound gets a 429 with Retry-After at once, read by the openai client, and no worker sees it.

Tenants (router/admission/tenants.py): a router with two tenants over a prefill and a decode of their own that run
SGLang's priority scheduling; one tenant over its quota is refused while the other is served, at its class's priority,
which both workers' own metrics count."""

from __future__ import annotations

import hashlib
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from pdcluster.local.models import DEMO_ARGS
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
    assert took < 5  # no queue, no worker: answered while the long prompt was still held (ms on an idle machine)
    response = refused.value.response
    assert response.status_code == 429
    assert response.headers["retry-after"] == str(math.ceil(booked / RATE - BOUND))
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", 429)
    assert f"would wait {booked / RATE:.1f}s" in error["message"]
    assert (held.generates, counted.generates) == (1, 1)  # the long request's halves only
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'pdcluster_router_admission_refusals_total{class="default",reason="predicted_wait"} 1.0' in metrics


GOLD_KEY, FREE_KEY = "sk-e2e-gold-5b1f", "sk-e2e-free-77c0"
HIGH = 5  # the gold tenant's class's priority


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def tenants_router(cluster, tmp_path_factory):
    """A prefill and a decode of the demo model with SGLang's priority scheduling (not registered: only this test's
    router uses them), and a router with two tenants over them: gold, of a class of priority HIGH, and free, at most
    one request per second."""
    work = tmp_path_factory.mktemp("tenants")
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    kv_port = cluster.spec.prefill.first_kv_bootstrap_port + 70
    events_port = cluster.spec.prefill.first_kv_events_port + 70
    common = [*DEMO_ARGS, "--enable-metrics", "--enable-priority-scheduling", "--default-priority-value", "0",
              "--cluster", "bootstrap_url=null"]
    commands = {
        "prefill": [sys.executable, "-m", "prefill", "--config", "configs/prefill.yaml", *common, "--port",
                    str(prefill_port), "--disaggregation-bootstrap-port", str(kv_port), "--cluster",
                    f"kv_events_port_base={events_port}"],
        "decode": [sys.executable, "-m", "decode", "--config", "configs/decode.yaml", *common, "--port",
                   str(decode_port)],
        "router": [sys.executable, "-m", "router", "--config", str(work / "router.yaml")]}
    (work / "router.yaml").write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": router_port, "bootstrap_url": None, "log_level": "info",
        "admission_check": False,
        "prefill": [{"url": f"http://127.0.0.1:{prefill_port}", "kv_bootstrap_port": kv_port,
                     "priority_scheduling": True}],
        "decode": [{"url": f"http://127.0.0.1:{decode_port}", "priority_scheduling": True}],
        "admission": {"classes": {"default": {}, "high": {"priority": HIGH}}},
        "tenants": {"gold": {"key_sha256": [_sha(GOLD_KEY)], "priority_class": "high"},
                    "free": {"key_sha256": [_sha(FREE_KEY)], "requests_per_second": 1}}}))
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, command in commands.items():
            with (work / f"{name}.log").open("wb") as log:
                processes[name] = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)
        url = f"http://127.0.0.1:{router_port}"
        logs = lambda: {name: (work / f"{name}.log").read_text()[-2000:] for name in commands}  # noqa: E731
        workers = [f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"]
        assert until(lambda: all(_healthy(w) for w in workers), 300, CLUSTER_POLL), logs()
        assert until(lambda: _ready(url), 60, CLUSTER_POLL), logs()  # (its static workers count as healthy at once)
        yield url, *workers, work
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _healthy(worker: str) -> bool:
    try:
        return httpx.get(f"{worker}/health", timeout=20).status_code == 200
    except httpx.HTTPError:
        return False


def _requests_at(metrics_url: str, priority: int) -> float:
    """SGLang's own count of the requests it finished with this priority (a label only under priority scheduling)."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total{") and f'priority="{priority}"' in line)


def test_a_tenant_over_its_quota_is_refused_while_another_is_served_at_its_class_priority(tenants_router):
    url, prefill_url, decode_url, work = tenants_router
    gold = openai.OpenAI(base_url=f"{url}/v1", api_key=GOLD_KEY, max_retries=0, timeout=60)
    free = openai.OpenAI(base_url=f"{url}/v1", api_key=FREE_KEY, max_retries=0, timeout=60)
    before = {at: (_requests_at(prefill_url, at), _requests_at(decode_url, at)) for at in (0, HIGH)}
    free.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=4)
    with pytest.raises(openai.RateLimitError) as refused:  # within the same second: over 1 request per second
        free.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=4)
    served = [gold.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=4)
              for _ in range(3)]
    assert all(answer.choices[0].text for answer in served)
    response = refused.value.response
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "tenant free is over its quota" in error["message"]
    # The class's priority reached both SGLang workers: their own metrics count the requests under it.
    assert until(lambda: (_requests_at(prefill_url, HIGH), _requests_at(decode_url, HIGH)) ==
                 (before[HIGH][0] + 3, before[HIGH][1] + 3), 10, 0.2), (before, _requests_at(decode_url, HIGH))
    assert (_requests_at(prefill_url, 0), _requests_at(decode_url, 0)) == (before[0][0] + 1, before[0][1] + 1)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'pdcluster_router_tenant_refusals_total{reason="requests_per_second",tenant="free"} 1.0' in metrics
    assert 'pdcluster_router_tenant_requests_total{status="200",tenant="gold"} 3.0' in metrics
    router_log = (work / "router.log").read_text()
    assert "answered" in router_log
    for secret in (GOLD_KEY, FREE_KEY, _sha(GOLD_KEY), _sha(FREE_KEY)):
        assert secret not in router_log


def test_a_model_no_worker_serves_is_a_404_and_the_served_one_is_answered(cluster):
    """Models by name (router/pd/pairing.py), on the shared router: the served name picks its pool, another is a 404
    model_not_found, before any worker is asked."""
    client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=4).choices[0].text
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="no-such-model", prompt="Once upon a time", max_tokens=4)
    error = refused.value.response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("model_not_found", "model", 404)
