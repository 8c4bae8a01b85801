"""Router behaviour that lives in SGLang: prefix affinity hits the radix cache, a disconnect frees KV slots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.prompts import prompt_of_about
from tests.helpers import CLUSTER_POLL, listing, until, used_tokens

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prefix_router(cluster, tmp_path_factory):
    """A second router on the same registry, with the prefix policy for prefills."""
    config = tmp_path_factory.mktemp("prefix-router") / "router.yaml"
    config.write_text("host: 127.0.0.1\nport: 18001\nprefill_policy: prefix\ndecode_policy: round_robin\n"
                      "expose_worker_ids: true\n"
                      f"bootstrap_url: {cluster.spec.bootstrap_url}\n")
    process = subprocess.Popen([sys.executable, "-m", "router", "--config", str(config)], cwd=REPO)
    url = "http://127.0.0.1:18001"
    try:
        assert until(lambda: _ok(f"{url}/ready"), timeout=60, interval=CLUSTER_POLL)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_prefix_policy_sends_a_shared_prefix_to_one_prefill_and_sglang_reuses_its_cache(prefix_router, reference):
    shared = prompt_of_about(reference.tokenizer, 300)
    shared_tokens = len(reference.tokenizer(shared)["input_ids"])
    prefills, cached = set(), []
    for question in ("What comes next?", "Why is that?", "Tell me more.", "And then?"):
        response = httpx.post(f"{prefix_router}/generate", timeout=120, json={
            "text": shared + " " + question, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert response.status_code == 200, response.text
        prefills.add(response.headers["x-pdcluster-prefill"])
        cached.append(response.json()["meta_info"]["cached_tokens"])
    assert len(prefills) == 1
    assert all(c >= 0.9 * shared_tokens for c in cached[1:]), (cached, shared_tokens)


def aborts_sent(router_url: str) -> dict[str, float]:
    text = httpx.get(f"{router_url}/metrics").text
    return {s.labels["role"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "pdcluster_router_aborts_sent_total"}


def test_client_disconnect_mid_stream_aborts_both_halves_and_frees_the_kv(cluster, router):
    decode_urls = {w["registration"]["worker_id"]: w["registration"]["url"].rstrip("/")
                   for w in listing(cluster, "decode")}
    baseline = {url: used_tokens(url) for url in decode_urls.values()}
    before = aborts_sent(cluster.router_url)
    body = {"text": "A long story, please", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    with router.stream("POST", "/generate", json=body) as response:
        decode_url = decode_urls[response.headers["x-pdcluster-decode"]]
        lines = response.iter_lines()
        for _ in range(20):
            next(lines)
        assert used_tokens(decode_url) > baseline[decode_url]
    # Leaving the block closes the connection: the client is gone.
    assert until(lambda: used_tokens(decode_url) == baseline[decode_url], timeout=10, interval=CLUSTER_POLL)
    after = aborts_sent(cluster.router_url)
    assert after.get("prefill", 0) == before.get("prefill", 0) + 1
    assert after.get("decode", 0) == before.get("decode", 0) + 1


def test_metrics_count_the_requests_sent(cluster, router):
    def count() -> float:
        text = httpx.get(f"{cluster.router_url}/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "pdcluster_router_requests_total" and s.labels == {"route": "/v1/completions",
                                                                                   "status": "200"})
    start = count()
    for i in range(3):
        response = router.post("/v1/completions", json={"model": "tiny-llama", "prompt": f"count {i}", "max_tokens": 2})
        assert response.status_code == 200
    assert count() == start + 3
