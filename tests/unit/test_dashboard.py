"""The Grafana dashboard (deploy/grafana/pdcluster.json) and the scrape config (deploy/prometheus/prometheus.yml) name
only metrics that exist: the router's, as router/metrics.py registers them, and SGLang's, as its source declares them.
A renamed metric fails here, not on an operator's empty panel. (tests/e2e/test_prometheus.py runs the queries.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import sglang
import yaml

from router.fleet.workers import WorkerPool
from router.metrics import RouterMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pdcluster.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
NAME = re.compile(r"\b(?:pdcluster_router_[a-z_]+|sglang:[a-z_0-9]+)")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def router_series() -> set[str]:
    """Every series name the router exposes (a counter's with _total, a histogram's _bucket/_sum/_count)."""
    names = set()
    for family in RouterMetrics(WorkerPool()).registry.collect():
        kind = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in kind}
    return names


def sglang_declared() -> set[str]:
    source = Path(sglang.__file__).parent / "srt" / "observability" / "metrics_collector.py"
    return set(re.findall(r'name="(sglang:[a-z_0-9]+)"', source.read_text()))


def exists_in_sglang(name: str, declared: set[str]) -> bool:
    return name in declared or any(name.endswith(s) and name.removesuffix(s) in declared for s in SUFFIXES)


def test_every_metric_the_dashboard_and_scrape_config_name_exists():
    router, declared = router_series(), sglang_declared()
    assert "sglang:inter_token_latency_seconds" in declared, "SGLang's metrics moved: fix sglang_declared()"
    texts = [*expressions(), SCRAPE_CONFIG.read_text()]
    named = {name for text in texts for name in NAME.findall(text)}
    assert {n for n in named if n.startswith("pdcluster_")} and {n for n in named if n.startswith("sglang:")}
    unknown = sorted(n for n in named if not (n in router if n.startswith("pdcluster_") else
                                              exists_in_sglang(n, declared)))
    assert not unknown, f"named but not exposed: {unknown}"


def test_the_dashboard_has_the_operators_panels_and_the_scrape_config_every_role():
    exprs = " ".join(expressions())
    for needed in ("pdcluster_router_ttft_seconds_bucket", "pdcluster_router_itl_seconds_bucket",
                   "sglang:inter_token_latency_seconds_bucket",
                   "sglang:kv_transfer_latency_ms_bucket", "pdcluster_router_cached_prompt_tokens_total",
                   "pdcluster_router_worker_healthy"):
        assert needed in exprs, needed
    jobs = {job["job_name"] for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]}
    assert jobs == {"router", "prefill", "decode"}  # the dashboard selects on these
