"""Routing by the prefills' own KV events, on the shared cluster: a second router, started here on the same
workers with the cache_aware policy (the cluster's own router keeps its round robin for the other tests), sends a
prompt's repeats with new suffixes to the prefill that holds it, and their answers report it cached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO
from tests.e2e.test_cache_hits import words
from tests.helpers import until

PORT = 18100


class RouterProcess:
    """A cache_aware router of its own over a cluster's workers (its bootstrap service's), which a test may restart."""

    def __init__(self, directory: Path, bootstrap_url: str, port: int = PORT):
        self.config, self.process = directory / "router.yaml", None
        self.config.write_text(f"host: 127.0.0.1\nport: {port}\nbootstrap_url: {bootstrap_url}\n"
                               "prefill_policy: cache_aware\nexpose_worker_ids: true\nlog_level: info\n")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

    def start(self) -> None:
        with (self.config.parent / "router.log").open("a") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "router", "--config", str(self.config)], cwd=REPO,
                                            stdout=log, stderr=subprocess.STDOUT)
        assert until(lambda: _ready(self.client), 120, 0.5), (self.config.parent / "router.log").read_text()[-3000:]

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)


@pytest.fixture(scope="module")
def cache_router(cluster, tmp_path_factory):
    router = RouterProcess(tmp_path_factory.mktemp("kv-routing"), cluster.spec.bootstrap_url)
    try:
        router.start()
        yield router
    finally:
        router.client.close()
        router.stop()


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
    client = cache_router.client
    shared = words("kv-routing", 600)
    first, _, _ = send(client, shared + " " + words("suffix-0", 20))
    # The prefill's BlockStored events reach the router after its batch: wait until it has indexed some pages.
    assert until(lambda: _indexed(client, first), 30, 0.2), client.get("/metrics").text[-3000:]
    landed = [send(client, shared + " " + words(f"suffix-{i}", 20)) for i in range(1, 7)]
    assert {prefill for prefill, _, _ in landed} == {first}, landed
    assert min(cached for _, cached, _ in landed) >= 500, landed  # most of the ~600-word shared part
    # By the last one the index holds the shared part's pages, and the answer's header says it expected them.
    assert (landed[-1][2] or 0) >= 500, landed
    metrics = client.get("/metrics").text
    assert 'pdcluster_router_routing_decisions_total{kind="indexed"}' in metrics
    assert 'pdcluster_router_kv_prediction_tokens_total{kind="actual"}' in metrics


def test_a_restarted_router_rebuilds_its_index_from_the_publishers_before_routing(cache_router):
    """A router that restarts is not blind: it replays what each prefill's publisher still buffers (SGLang keeps its
    last 10,000 batches), so a prompt served before the restart draws its repeat to its holder, predicted."""
    client = cache_router.client
    shared = words("kv-routing-restart", 600)
    first, _, _ = send(client, shared + " " + words("before", 20))
    assert until(lambda: _indexed(client, first), 30, 0.2), client.get("/metrics").text[-3000:]
    cache_router.stop()
    cache_router.start()
    # Nothing was sent since: what the new router's index holds came from the replay.
    assert until(lambda: _indexed(client, first), 30, 0.2), client.get("/metrics").text[-3000:]
    prefill, cached, predicted = send(client, shared + " " + words("after", 20))
    assert prefill == first and cached >= 500 and (predicted or 0) >= 500, (prefill, first, cached, predicted)
    assert 'pdcluster_router_routing_decisions_total{kind="blind"}' not in client.get("/metrics").text


def index_pages(client: httpx.Client) -> dict[str, float]:
    """The pages the router's KV index holds per prefill (in memory), by its metric."""
    found = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('pdcluster_router_kv_index_pages{worker="'):
            found[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return found


def _indexed(client: httpx.Client, worker_id: str) -> bool:
    return index_pages(client).get(worker_id, 0) > 0
