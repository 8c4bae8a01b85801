"""bench.cluster's verdicts: medians over repeats, ratios, and "within noise" when the repeats' ranges overlap, so
bench/README.md never reads a ratio as a difference when the repeats do not support it."""

from __future__ import annotations

import pytest

from bench.cluster import report as cluster_report
from bench.harness.clusters import MODELS, colocated_command


def run(target: str, throughput: float, ttft: float, workload: str = "random", session: str = "main",
        repeat: int = 0, probe: float | None = None) -> dict:
    return {"session": session, "target": target, "workload": workload, "request_throughput": throughput,
            "median_ttft_ms": ttft, "errors": 0, "repeat": repeat, "machine_probe_ms": probe}


def test_ratio_of_medians_and_noise_verdict():
    runs = [run("ours", t, 100) for t in (2.0, 2.2, 2.1)] + [run("sglang", t, f) for t, f in
                                                             ((1.0, 90), (1.1, 120), (1.05, 95))]
    derived = cluster_report.derive(cluster_report.summarize(runs), {})
    ratios = derived["ratios"]["ours / SGLang router (random)"]
    assert ratios["request_throughput"] == {"ratio": 2.0, "within_noise": False}  # 2.1 / 1.05, ranges apart
    assert ratios["median_ttft_ms"]["within_noise"] is True  # 100 lies inside SGLang's 90-120


def test_summary_keeps_every_repeat_and_its_spread():
    summary = cluster_report.summarize([run("ours", t, 100) for t in (1.0, 3.0, 2.0)])
    cell = summary["main/ours/random"]["request_throughput"]
    assert (cell["median"], cell["min"], cell["max"], cell["runs"], cell["spread_pct"]) == (
        2.0, 1.0, 3.0, [1.0, 3.0, 2.0], 100.0)


def test_idle_verdict_against_a_tenth_of_a_core():
    idle = {"sleep_on_idle_on": {"local_yaml_shape_total": 0.04, "others": 0.3},
            "sleep_on_idle_off": {"local_yaml_shape_total": 1.5, "others": 0.3}}
    verdicts = cluster_report.derive({}, idle)["idle_local_cluster"]
    assert verdicts["sleep_on_idle_on"]["pass"] and not verdicts["sleep_on_idle_off"]["pass"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_colocated_server_is_not_disaggregated_and_gets_the_pd_workers_kv_pool(name):
    argv, env = colocated_command(MODELS[name], 27500, sleep_on_idle=True)
    assert not any(a.startswith("--disaggregation") for a in argv)
    assert "--sleep-on-idle" in argv and env["SGLANG_USE_CPU_ENGINE"] == "1"
    pool = {"tiny-llama": "65536", "smollm2": "16384"}[name]  # what DEMO_ARGS / the CPU profile give the PD workers
    assert argv[argv.index("--max-total-tokens") + 1] == pool and argv.count("--max-total-tokens") == 1
    assert argv[argv.index("--model-path") + 1] == MODELS[name].path


def test_paired_ratios_see_through_a_drift_that_the_ranges_hide():
    # The machine slows down between repeats; within each one ours is 10% ahead.
    speeds = (2.0, 1.0, 3.0)
    runs = ([run("ours", 1.1 * v, 100, repeat=i) for i, v in enumerate(speeds)]
            + [run("sglang", v, 100, repeat=i) for i, v in enumerate(speeds)])
    derived = cluster_report.derive(cluster_report.summarize(runs), {}, runs)
    throughput = derived["ratios"]["ours / SGLang router (random)"]["request_throughput"]
    assert throughput["within_noise"] is True
    assert throughput["paired"] == [1.1, 1.1, 1.1] and throughput["same_side_every_repeat"] is True
    assert throughput["paired_spread_pct"] == 0.0
    assert cluster_report.summarize(runs)["main/ours/random"]["request_throughput"]["spread_pct"] == 100.0
    ttft = derived["ratios"]["ours / SGLang router (random)"]["median_ttft_ms"]
    assert ttft["paired"] == [1.0, 1.0, 1.0] and ttft["same_side_every_repeat"] is False


def test_machine_speed_spread_over_every_run():
    runs = [run("ours", 1.0, 100, repeat=i, probe=p) for i, p in enumerate((100.0, 150.0, 200.0))]
    runs.append(run("ours", 1.0, 100, session="busy-poll", probe=900.0))  # competing with busy-polling schedulers
    derived = cluster_report.derive(cluster_report.summarize(runs), {}, runs)
    assert derived["machine_speed"]["main"] == {"probe_ms_median": 150.0, "min": 100.0, "max": 200.0,
                                                "spread_pct": 66.7}
    assert derived["machine_speed"]["busy-poll"]["probe_ms_median"] == 900.0
    assert any("spread 67%" in line for line in cluster_report.lines(derived))


def test_the_twin_of_our_router_is_the_noise_control():
    runs = [run("ours", 5.0, 400, repeat=0), run("ours-twin", 4.0, 400, repeat=0), run("sglang", 4.5, 400, repeat=0)]
    ratios = cluster_report.derive(cluster_report.summarize(runs), {}, runs)["ratios"]
    assert ratios["ours / ours twin (random, A/A: the noise)"]["request_throughput"]["paired"] == [1.25]
    assert ratios["ours / SGLang router (random)"]["request_throughput"]["paired"] == [1.111]
