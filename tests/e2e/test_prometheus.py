"""A real Prometheus (Debian's `prometheus`, installed by `make setup`) scraping the shared cluster's router and every
worker each second, and the operator's queries (the Grafana dashboard's, deploy/grafana/pdcluster.json) answered
from what it scraped: the request count is what was sent, TTFT and ITL per route are there, every target is up."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import WORKERS
from tests.helpers import free_port, until, worker_url

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pdcluster.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ROUTE = "/v1/completions"  # other modules' requests count too: only the change is asserted
SENT = 6


def scrape_config(cluster) -> dict:
    """deploy/prometheus/prometheus.yml (jobs router, prefill, decode; its relabelling) on the test cluster's ports."""
    jobs: dict[str, list[str]] = {"router": [cluster.router_url.removeprefix("http://")]}
    for name in WORKERS:
        jobs.setdefault(name.split("-")[0], []).append(worker_url(cluster, name).removeprefix("http://"))
    deployed = {job["job_name"]: job for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]}
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{**deployed[job], "scrape_timeout": "1s", "static_configs": [{"targets": targets}]}
                               for job, targets in jobs.items()]}


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory) -> Iterator[httpx.Client]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `make setup` installs Debian's package"
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(cluster)))
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            def ready() -> bool:
                try:
                    return client.get("/-/ready").status_code == 200
                except httpx.HTTPError:
                    return process.poll() is not None  # exited: stop waiting, fail below
            assert until(ready, 30, 0.2) and process.poll() is None, (work / "prometheus.log").read_text()
            yield client
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def query(prometheus: httpx.Client, expr: str) -> list[dict]:
    answer = prometheus.get("/api/v1/query", params={"query": expr}).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def value(prometheus: httpx.Client, expr: str) -> float | None:
    result = query(prometheus, expr)
    return float(result[0]["value"][1]) if result else None


def requests_counted(prometheus: httpx.Client) -> float:
    return value(prometheus, f'sum(pdcluster_router_requests_total{{route="{ROUTE}",status="200"}})') or 0.0


def streamed_timed(prometheus: httpx.Client) -> float:
    return value(prometheus, f'sum(pdcluster_router_ttft_seconds_count{{route="{ROUTE}"}})') or 0.0


def streamed_itl(prometheus: httpx.Client) -> float:
    return value(prometheus, f'sum(pdcluster_router_itl_seconds_count{{route="{ROUTE}"}})') or 0.0


def sglang_ttft(prometheus: httpx.Client) -> float:
    return value(prometheus, 'sum(sglang:time_to_first_token_seconds_count{job="decode"})') or 0.0


def scraped_after(prometheus: httpx.Client, moment: float) -> bool:
    """Every target scraped after `moment` (unix time)."""
    targets = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
    return len(targets) == 1 + len(WORKERS) and all(
        t["lastScrape"] and _unix(t["lastScrape"]) > moment for t in targets)


def _unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def test_the_operators_queries_answer_from_a_real_prometheus(cluster, router, prometheus):
    started = time.time()  # once: a moment taken anew at each try would always be after the last scrape
    assert until(lambda: scraped_after(prometheus, started), 30, 0.5)
    before, streamed_before, itl_before = requests_counted(prometheus), streamed_timed(prometheus), streamed_itl(
        prometheus)
    sglang_before = sglang_ttft(prometheus)
    for i in range(SENT):
        body = {"prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": i % 2 == 0}
        with router.stream("POST", ROUTE, json=body) as response:
            assert response.status_code == 200
            response.read()
    sent_at = time.time()
    assert until(lambda: scraped_after(prometheus, sent_at + 1), 30, 0.5)

    assert requests_counted(prometheus) - before == SENT
    up = query(prometheus, "up")
    assert len(up) == 1 + len(WORKERS) and all(r["value"][1] == "1" for r in up), up
    # Streamed requests were timed to their first token by the router: as many as were streamed, in the scrape.
    assert streamed_timed(prometheus) - streamed_before == (SENT + 1) // 2
    # ... and each timed its gaps between tokens, once: the operator's ITL per route answers, between 0 and a second.
    assert streamed_itl(prometheus) - itl_before == (SENT + 1) // 2
    buckets = f'pdcluster_router_itl_seconds_bucket{{route="{ROUTE}"}}'
    p95 = value(prometheus, f"histogram_quantile(0.95, sum by (le) ({buckets}))")
    assert p95 is not None and 0 < p95 <= 1, p95
    # SGLang's own series, under the names it documents: the decodes timed every request's first token (its HTTP
    # process's series, which reach /metrics only through the launcher's metrics directory), and every worker's
    # scheduler reports its running requests.
    assert sglang_ttft(prometheus) - sglang_before == SENT
    assert value(prometheus, 'count(sglang:num_running_reqs{job=~"prefill|decode"})') == len(WORKERS)
    assert value(prometheus, "count(pdcluster_router_worker_healthy == 1)") == len(WORKERS)
    assert value(prometheus, "count(pdcluster_router_worker_healthy == 0)") is None  # none unusable


def test_every_dashboard_query_is_valid_promql_on_the_scraped_data(prometheus):
    """Each panel's query runs (Grafana's variables given the values Grafana would): a typo or a function Prometheus
    lacks fails here. Some may be empty (no retry happened, no tier reported), none may error."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert exprs
    for expr in exprs:
        query(prometheus, expr.replace("$__rate_interval", "1m").replace("$route", ".*"))
