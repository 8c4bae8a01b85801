"""The live planner (planner/live.py, scrape.py, fleet.py, exported.py): one interval's decision from the router's
metrics, as the real router/metrics.py writes them, and a registry listing, both served in-process by a fake
router-and-bootstrap (httpx.MockTransport); what it exports; what it asks the bootstrap service; `--dry-run`.

The hand profile and config of test_planner_sizing.py: 1 request/s of 500 prompt tokens and 2 answer tokens needs
7 prefills and 0.24 decodes (a decision counts prefills up to the fleet's 4, then 5/0.9 = 5.56), so a 2P2D fleet
should become 3P1D (the tighter role from 2.78 to 1.85, a third less), and a pool scaled to the load be 7P1D.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdcluster.common.protocol import Role
from pdcluster.local.cluster import LocalCluster
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from planner.config import PlannerConfig
from planner.exported import PlannerMetrics
from planner.live import LivePlanner, router_urls
from planner.scrape import Windower, merged, parse, within
from planner.sizing import Split
from router.fleet.workers import Worker, WorkerPool
from router.metrics import RouterMetrics
from tests.helpers import free_port, until
from tests.unit.test_planner_simulator import PROFILE
from tests.unit.test_planner_sizing import CONFIG

ROUTE = "/generate"
IDENTITY = {"model_path": "m", "served_model_name": "m", "page_size": 1, "kv_cache_dtype": "auto",
            "transfer_backend": "mooncake"}


def url(worker_id: str) -> str:
    return f"http://10.0.0.{sum(map(ord, worker_id)) % 250}:30000"


class FakeCluster:
    """The router's /metrics (a real RouterMetrics) and the bootstrap service's listing and switch route."""

    def __init__(self, roles: dict[str, str], answer: int = 202, error_code: str = "", fixed: tuple[str, ...] = ()):
        self.pool = WorkerPool()
        self.fixed = fixed  # workers registered without SGLang's role switch
        self.metrics = RouterMetrics(self.pool)
        self.roles = dict(roles)
        self.switches: dict[str, dict] = {}
        self.asked: list[tuple[str, dict, str | None]] = []  # (worker id, body, Authorization)
        self.answer, self.error_code = answer, error_code
        for worker_id, role in roles.items():
            self.pool.workers[worker_id] = Worker(worker_id, Role(role), url(worker_id))
        self.client = httpx.Client(transport=httpx.MockTransport(self.handle))

    def serve(self, requests: int, prompt: int, answer: int, ttft: float = 1.0, itl: float = 0.1) -> None:
        """`requests` answers as the router would count them."""
        for _ in range(requests):
            self.metrics.requests.labels(ROUTE, "200").inc()
            self.metrics.ttft.labels(ROUTE).observe(ttft)
            self.metrics.itl.labels(ROUTE).observe(itl)
            self.metrics.count_cached(json.dumps({"text": "x", "meta_info": {
                "prompt_tokens": prompt, "completion_tokens": answer, "cached_tokens": 0}}).encode())

    def listing(self) -> dict:
        rows = []
        for worker_id, role in self.roles.items():
            registration = {"worker_id": worker_id, "role": role, "url": url(worker_id), "identity": IDENTITY,
                            "switch_enabled": worker_id not in self.fixed}
            if role == "prefill":
                registration |= {"kv_bootstrap_host": "10.0.0.1", "kv_bootstrap_port": 8999}
            row = {"registration": registration, "healthy": True, "registered_at": 0.0, "last_heartbeat": 0.0}
            if worker_id in self.switches:
                row["switch"] = self.switches[worker_id]
            rows.append(row)
        return {"version": 1, "ttl_seconds": 5.0, "uptime_seconds": 100.0, "workers": rows}

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, content=self.metrics.render())
        if request.url.path == "/v1/workers":
            return httpx.Response(200, json=self.listing())
        worker_id = request.url.path.split("/")[3]
        body = json.loads(request.content)
        self.asked.append((worker_id, body, request.headers.get("authorization")))
        if self.answer != 202:
            error = {"message": "no", "code": self.answer, "refusal": self.error_code}  # as bootstrap/app.py answers
            return httpx.Response(self.answer, json={"error": error})
        self.switches[worker_id] = {"to": body["to"], "state": "draining", "started": 0.0}
        return httpx.Response(202, json={"worker_id": worker_id, "from": self.roles[worker_id], "to": body["to"],
                                         "state": "draining"})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def planner(cluster: FakeCluster, **config) -> tuple[LivePlanner, Clock]:
    clock = Clock()
    settings = CONFIG.model_copy(update={"interval_s": 60.0, "min_judged": 1000, "token": "secret", **config})
    return LivePlanner(settings, PROFILE, cluster.client, PlannerMetrics(), clock), clock


def interval(live: LivePlanner, clock: Clock, cluster: FakeCluster, requests: int = 60, prompt: int = 500,
             answer: int = 2):
    """One minute of `requests` answers, then the planner's step."""
    cluster.serve(requests, prompt, answer)
    clock.now += 60
    return live.step()


PROMPT_HEAVY_2P2D = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}


def sample(live: LivePlanner, name: str, **labels: str) -> float | None:
    return live.metrics.registry.get_sample_value(name, labels)


def test_the_first_step_is_a_baseline_then_each_interval_decides():
    cluster = FakeCluster(PROMPT_HEAVY_2P2D)
    live, clock = planner(cluster)
    assert live.step() is None
    # No decision yet: no needed workers exported (an autoscaler keeps its replicas rather than read a 0).
    assert sample(live, "pdcluster_planner_needed_workers", role="prefill") is None
    decision = interval(live, clock, cluster)
    assert decision is not None and decision.current == Split(2, 2) and decision.desired == Split(3, 1)
    assert decision.predicted.requests_per_s == pytest.approx(1.0)
    assert (decision.predicted.prompt_tokens, decision.predicted.answer_tokens) == (500, 2)
    assert decision.observed is not None and decision.observed.ttft_attainment == 1.0


def test_recommend_exports_and_logs_the_decision_and_flips_nothing(caplog):
    cluster = FakeCluster(PROMPT_HEAVY_2P2D)
    live, clock = planner(cluster, mode="recommend")
    live.step()
    with caplog.at_level("INFO", logger="pdcluster.planner"):
        interval(live, clock, cluster)
    assert cluster.asked == []
    (line,) = [r.getMessage() for r in caplog.records if "desired=" in r.getMessage()]
    assert "split=2P2D desired=3P1D predicted rps=1.000 prompt=500 answer=2" in line
    assert "recommend: no flip asked for" in line
    assert sample(live, "pdcluster_planner_desired_workers", role="prefill") == 3
    assert sample(live, "pdcluster_planner_desired_workers", role="decode") == 1
    assert sample(live, "pdcluster_planner_observed_workers", role="prefill") == 2
    assert sample(live, "pdcluster_planner_needed_workers", role="prefill") == 7
    assert sample(live, "pdcluster_planner_needed_workers", role="decode") == 1
    assert sample(live, "pdcluster_planner_desired_pool_size") == 8
    assert sample(live, "pdcluster_planner_desired_pool_workers") == 8  # no fixed worker: the pool is all of it
    assert sample(live, "pdcluster_planner_predicted", quantity="requests_per_s") == pytest.approx(1.0)
    assert sample(live, "pdcluster_planner_decisions_total", verdict="change") == 1
    info = sample(live, "pdcluster_planner_decision_info", verdict="change", desired="3P1D",
                  reason=line.split("reason=")[1].strip("'"))
    assert info == 1
    text = live.metrics.render().decode()
    assert 'pdcluster_planner_flips_total{result="accepted"} 0.0' in text


def test_act_flips_the_decode_with_fewest_requests_in_flight_with_the_token():
    cluster = FakeCluster({"p1": "prefill", "d1": "decode", "d2": "decode", "d3": "decode"})
    cluster.pool.workers["d1"].in_flight, cluster.pool.workers["d2"].in_flight = 3, 1
    cluster.pool.workers["d3"].in_flight = 2
    live, clock = planner(cluster, mode="act")
    live.step()
    decision = interval(live, clock, cluster)
    assert decision is not None and decision.desired == Split(3, 1)
    assert cluster.asked == [("d2", {"to": "prefill"}, "Bearer secret")]  # one flip at a time, the cheapest
    assert sample(live, "pdcluster_planner_flips_total", result="accepted") == 1
    # The next interval: d2 is switching (counted as a prefill already): no second flip while it runs.
    decision = interval(live, clock, cluster)
    assert decision is not None and decision.current == Split(2, 2)
    assert len(cluster.asked) == 1
    # The registry reports it done: counted, and the next flip may go.
    cluster.roles["d2"], cluster.switches["d2"] = "prefill", {"to": "prefill", "state": "done", "started": 0.0}
    interval(live, clock, cluster)
    assert sample(live, "pdcluster_planner_flips_total", result="done") == 1
    assert [a[0] for a in cluster.asked] == ["d2", "d3"]


def test_a_prefill_to_flip_is_the_one_with_least_cached_prefix_when_in_flight_ties():
    cluster = FakeCluster({"p1": "prefill", "p2": "prefill", "p3": "prefill", "d1": "decode"})
    cluster.metrics.set_kv_index_sizes({"p1": 500, "p2": 40, "p3": 900})
    live, clock = planner(cluster, mode="act")
    live.step()
    decision = interval(live, clock, cluster, requests=60, prompt=50, answer=200)  # answer-heavy: decodes wanted
    assert decision is not None and decision.desired.decode > 1
    assert cluster.asked == [("p2", {"to": "decode"}, "Bearer secret")]


def test_a_pools_fixed_workers_are_never_flipped_and_its_autoscaler_adds_only_what_they_lack():
    """The chart's role-flexible pool: one prefill and one decode started without the role switch (they keep a worker
    of each role whatever Kubernetes removes), the rest switch-enabled. The load needs 7P1D."""
    roles = {"p-fixed": "prefill", "d-fixed": "decode", "d-pool1": "decode", "d-pool2": "decode"}
    cluster = FakeCluster(roles, fixed=("p-fixed", "d-fixed"))
    cluster.pool.workers["d-fixed"].in_flight = 0
    cluster.pool.workers["d-pool1"].in_flight, cluster.pool.workers["d-pool2"].in_flight = 2, 1
    live, clock = planner(cluster, mode="act")
    live.step()
    decision = interval(live, clock, cluster)
    assert decision is not None and decision.desired.prefill > decision.current.prefill
    # d-fixed has the fewest requests in flight, but a flip of it would only be refused: the cheapest pool decode.
    assert cluster.asked == [("d-pool2", {"to": "prefill"}, "Bearer secret")]
    assert sample(live, "pdcluster_planner_desired_pool_size") == 8
    # 7 prefills less the fixed one, 1 decode less the fixed one: 6 switch-enabled workers.
    assert sample(live, "pdcluster_planner_desired_pool_workers") == 6


def test_fixed_workers_beyond_a_roles_need_do_not_stand_in_for_the_other_role():
    roles = {"p1": "prefill", "p2": "prefill", "p3": "prefill", "d1": "decode", "d2": "decode"}
    cluster = FakeCluster(roles, fixed=("p1", "p2", "p3", "d1", "d2"))
    live, clock = planner(cluster, mode="recommend")
    live.step()
    interval(live, clock, cluster)
    assert sample(live, "pdcluster_planner_needed_workers", role="decode") == 1
    # 7 prefills needed, 3 fixed; the decode's need is covered by its fixed two (one spare, not counted as a prefill).
    assert sample(live, "pdcluster_planner_desired_pool_workers") == 4


def test_a_refused_flip_is_counted_logged_and_not_retried_within_the_dwell(caplog):
    cluster = FakeCluster(PROMPT_HEAVY_2P2D, answer=409, error_code="not_switch_enabled")
    live, clock = planner(cluster, mode="act", dwell_s=600)
    live.step()
    with caplog.at_level("WARNING", logger="pdcluster.planner"):
        interval(live, clock, cluster)
    assert len(cluster.asked) == 1 and sample(live, "pdcluster_planner_flips_total", result="refused") == 1
    assert any("flip refused" in r.getMessage() and "not_switch_enabled" in r.getMessage() for r in caplog.records)
    for _ in range(9):  # 9 more minutes: within the 600 s dwell, still wanted, never asked again
        decision = interval(live, clock, cluster)
        assert decision is not None and decision.changes
    assert len(cluster.asked) == 1
    interval(live, clock, cluster)  # 11 minutes after the refusal: tried again
    assert len(cluster.asked) == 2


def test_a_failed_flip_is_counted_and_the_dwell_starts_again():
    cluster = FakeCluster(PROMPT_HEAVY_2P2D)
    live, clock = planner(cluster, mode="act", dwell_s=300)
    live.step()
    interval(live, clock, cluster)
    cluster.switches["d1"] = {"to": "prefill", "state": "failed", "reason": "backend_cannot", "started": 0.0}
    interval(live, clock, cluster)
    assert sample(live, "pdcluster_planner_flips_total", result="failed") == 1
    assert len(cluster.asked) == 1


def test_hysteresis_holds_a_small_gain_and_two_workers_stay_one_of_each():
    cluster = FakeCluster({"p1": "prefill", "d1": "decode"})
    live, clock = planner(cluster, mode="act")
    live.step()
    decision = interval(live, clock, cluster)  # prompt-heavy, but 1P1D is all two workers can be
    assert decision is not None and not decision.changes and cluster.asked == []
    balanced = FakeCluster(PROMPT_HEAVY_2P2D)
    live, clock = planner(balanced, mode="act", hysteresis=0.5)  # 2.78 -> 1.85 is a third: less than half
    live.step()
    decision = interval(live, clock, balanced)
    assert decision is not None and not decision.changes and "hysteresis" in decision.reason
    assert balanced.asked == []


def test_dwell_holds_a_reversal_after_a_change():
    cluster = FakeCluster(PROMPT_HEAVY_2P2D)
    live, clock = planner(cluster, mode="recommend", dwell_s=600, window=1)
    live.step()
    assert interval(live, clock, cluster).desired == Split(3, 1)  # the change: toward prefill
    decision = interval(live, clock, cluster, prompt=50, answer=200)  # answer-heavy now: a reversal, held
    assert decision is not None and not decision.changes and "dwell" in decision.reason


def test_no_decision_without_one_worker_of_each_role():
    cluster = FakeCluster({"p1": "prefill", "p2": "prefill"})
    live, clock = planner(cluster, mode="act")
    live.step()
    assert interval(live, clock, cluster) is None and cluster.asked == []


def test_scrape_reads_the_routers_series_and_windows_them():
    cluster = FakeCluster({"p1": "prefill", "d1": "decode"})
    cluster.pool.workers["p1"].in_flight = 4
    cluster.pool.workers["p1"].book(900, 700)
    cluster.metrics.set_kv_index_sizes({"p1": 12})
    cluster.metrics.requests.labels(ROUTE, "400").inc()  # refused requests are not load
    cluster.serve(10, prompt=100, answer=20, ttft=1.0, itl=0.2)
    before = parse(cluster.metrics.render().decode())
    assert before.answered_ok == 10 and before.usage_answers == 10 and before.prompt_tokens == 1000
    assert before.in_flight[url("p1")] == 4 and before.queued_tokens[url("p1")] == 700 and before.kv_pages["p1"] == 12
    windows = Windower(ttft_bound_s=2.0, itl_bound_s=0.15)
    assert windows.observe({"a": before}, 60) is None
    cluster.serve(30, prompt=300, answer=10, ttft=5.0, itl=0.1)
    seen = windows.observe({"a": parse(cluster.metrics.render().decode())}, 60)
    assert seen is not None
    assert (seen.load.requests_per_s, seen.load.prompt_tokens, seen.load.answer_tokens) == (0.5, 300, 10)
    assert (seen.ttft_met, seen.ttft_judged, seen.itl_met, seen.itl_judged) == (0, 30, 30, 30)
    # Router a restarts (counts from zero) and router b appears (its first scrape is only its baseline).
    restarted, other = FakeCluster({"p1": "prefill", "d1": "decode"}), FakeCluster({"p1": "prefill", "d1": "decode"})
    restarted.serve(3, prompt=100, answer=5)
    other.serve(50, prompt=100, answer=5)
    scrapes = {"a": parse(restarted.metrics.render().decode()), "b": parse(other.metrics.render().decode())}
    seen = windows.observe(scrapes, 60)
    assert seen is not None and seen.load.requests_per_s == pytest.approx(3 / 60) and seen.ttft_judged == 3
    # Both routers count the next interval: their answers add up.
    restarted.serve(6, prompt=100, answer=5, ttft=1.0)
    other.serve(12, prompt=400, answer=5, ttft=9.0)
    scrapes = {"a": parse(restarted.metrics.render().decode()), "b": parse(other.metrics.render().decode())}
    seen = windows.observe(scrapes, 60)
    assert seen is not None and seen.load.requests_per_s == pytest.approx(18 / 60)
    assert seen.load.prompt_tokens == pytest.approx((6 * 100 + 12 * 400) / 18)
    assert (seen.ttft_met, seen.ttft_judged) == (6, 18)
    gauges = merged([parse(cluster.metrics.render().decode()), parse(cluster.metrics.render().decode())])
    assert gauges.in_flight[url("p1")] == 8 and gauges.kv_pages["p1"] == 12  # in flight adds up; an index is one


def test_router_urls_are_one_per_address_of_the_name():
    assert router_urls("http://127.0.0.1:8000/") == ["http://127.0.0.1:8000"]
    assert router_urls("http://localhost:8000") == ["http://localhost:8000"]  # ::1 and 127.0.0.1: one router
    assert router_urls("http://no-such-host.invalid:8000") == ["http://no-such-host.invalid:8000"]


def test_within_interpolates_inside_the_bucket_that_holds_the_bound():
    buckets = {0.1: 10.0, 0.5: 30.0, math.inf: 40.0}
    assert within(buckets, 0.3) == (20, 40)
    assert within(buckets, 0.1) == (10, 40) and within(buckets, 5.0) == (30, 40) and within({}, 1.0) == (0, 0)


def test_an_interval_costs_well_under_one_percent_of_a_core():
    """60 workers' series: a step's CPU time against a one-minute interval."""
    roles = {f"w{i}": "prefill" if i % 2 else "decode" for i in range(60)}
    cluster = FakeCluster(roles)
    live, clock = planner(cluster, mode="recommend")
    live.step()
    began = time.process_time()
    for _ in range(5):
        interval(live, clock, cluster, requests=5)
    per_step = (time.process_time() - began) / 5
    assert per_step < 0.01 * 60 / 10, f"{per_step * 1000:.1f} ms of CPU per step"  # a tenth of the 1% budget


def test_dry_run_validates_the_config_and_profile_and_prints_no_token():
    done = subprocess.run([sys.executable, "-m", "planner", "--config", "configs/planner.yaml", "--dry-run"],
                          capture_output=True, text=True, env={"PDCLUSTER_TOKEN": "hush", "PATH": ""}, timeout=60)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["mode"] == "recommend" and printed["ttft"] == {"percentile": 90.0, "bound_s": 30.0}
    assert "hush" not in done.stdout and "token" not in printed
    bad = subprocess.run([sys.executable, "-m", "planner", "--config", "configs/planner.yaml", "--dry-run",
                          "--mode", "flip"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'flip'" in bad.stderr


def test_the_planner_config_keeps_its_defaults_in_the_file():
    assert PlannerConfig.from_file("configs/planner.yaml").port == 9300


def test_the_local_launcher_starts_the_planner_with_its_clusters_urls_and_it_serves_its_metrics(tmp_path):
    """`make up PLANNER=1`: pdcluster.local's own command for the planner, run; with no router to read, it logs a
    skipped interval and still serves its metrics; SIGTERM stops it cleanly."""
    port = free_port()
    spec = LocalSpec(bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=free_port()),
                     router=ComponentSpec(config="configs/router.yaml", port=free_port()),
                     prefill=WorkerGroupSpec(config="x", count=0, first_port=1024),
                     decode=WorkerGroupSpec(config="x", count=0, first_port=1024),
                     planner=ComponentSpec(config="configs/planner.yaml", port=port))
    cluster = LocalCluster(spec, tmp_path)
    process = cluster.processes["planner"]
    assert process.command[1:] == ["-m", "planner", "--config", "configs/planner.yaml", "--host", "127.0.0.1",
                                   "--port", str(port), "--router-url", spec.router_url,
                                   "--bootstrap-url", spec.bootstrap_url]
    process.start()
    try:
        assert until(lambda: _metrics(port), timeout=60, interval=0.2), process.tail()
        assert 'pdcluster_planner_flips_total{result="refused"} 0.0' in (_metrics(port) or "")
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert (health.status_code, health.text) == (200, "ok\n")
        assert until(lambda: "skipped an interval" in process.tail(), timeout=30, interval=0.2), process.tail()
    finally:
        process.signal(signal.SIGTERM)
        assert process.popen is not None and process.popen.wait(timeout=30) == 0, process.tail()


def _metrics(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
