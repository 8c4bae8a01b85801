"""Routing by the prefills' own KV events, on the shared cluster: a second router, started here on the same
workers with the cache_aware policy (the cluster's own router keeps its round robin for the other tests), sends a
prompt's repeats with new suffixes to the prefill that holds it, and their answers report it cached."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import REPO
from tests.e2e.test_cache_hits import words
from tests.helpers import until

PORT = 18100


@pytest.fixture(scope="module")
def cache_router(cluster, tmp_path_factory):
    config = tmp_path_factory.mktemp("kv-routing") / "router.yaml"
    config.write_text(f"host: 127.0.0.1\nport: {PORT}\nbootstrap_url: {cluster.spec.bootstrap_url}\n"
                      "prefill_policy: cache_aware\nexpose_worker_ids: true\nlog_level: info\n")
    log = (config.parent / "router.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "router", "--config", str(config)], cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120)
    try:
        assert until(lambda: _ready(client), 120, 0.5), (config.parent / "router.log").read_text()[-3000:]
        yield client
    finally:
        client.close()
        process.terminate()
        process.wait(30)
        log.close()


def _ready(client: httpx.Client) -> bool:
    try:
        return client.get("/ready").status_code == 200
    except httpx.HTTPError:
        return False


def send(client: httpx.Client, text: str) -> tuple[str, int, int | None]:
    """The prefill that served it, the cached tokens its answer reports, and those the router predicted there."""
    response = client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4,
                                                                                "temperature": 0}})
    assert response.status_code == 200, response.text
    predicted = response.headers.get("x-pdcluster-cached-tokens-predicted")
    return (response.headers["x-pdcluster-prefill"], response.json()["meta_info"]["cached_tokens"],
            int(predicted) if predicted is not None else None)


def test_a_prompts_repeats_go_to_the_prefill_that_holds_it(cache_router):
    shared = words("kv-routing", 600)
    first, _, _ = send(cache_router, shared + " " + words("suffix-0", 20))
    # The prefill's BlockStored events reach the router after its batch: wait until it has indexed some pages.
    assert until(lambda: _indexed(cache_router, first), 30, 0.2), cache_router.get("/metrics").text[-3000:]
    landed = [send(cache_router, shared + " " + words(f"suffix-{i}", 20)) for i in range(1, 7)]
    assert {prefill for prefill, _, _ in landed} == {first}, landed
    assert min(cached for _, cached, _ in landed) >= 500, landed  # most of the ~600-word shared part
    # By the last one the index holds the shared part's pages, and the answer's header says it expected them.
    assert (landed[-1][2] or 0) >= 500, landed
    metrics = cache_router.get("/metrics").text
    assert 'pdcluster_router_routing_decisions_total{kind="indexed"}' in metrics
    assert 'pdcluster_router_kv_prediction_tokens_total{kind="actual"}' in metrics


def _indexed(client: httpx.Client, worker_id: str) -> bool:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'pdcluster_router_kv_index_pages{{worker="{worker_id}"}}'):
            return float(line.rsplit(" ", 1)[1]) > 0
    return False
