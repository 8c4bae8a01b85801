"""bench.cluster's verdicts: medians over repeats, ratios, and "within noise" when the repeats' ranges overlap, so
bench/README.md never reads a ratio as a difference when the repeats do not support it."""

from __future__ import annotations

from bench import cluster_report
from bench.cluster_targets import colocated_command


def run(target: str, throughput: float, ttft: float, workload: str = "random", session: str = "main") -> dict:
    return {"session": session, "target": target, "workload": workload, "request_throughput": throughput,
            "median_ttft_ms": ttft, "errors": 0}


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


def test_colocated_server_is_not_disaggregated():
    argv, env = colocated_command(27500, sleep_on_idle=True)
    assert not any(a.startswith("--disaggregation") for a in argv)
    assert "--sleep-on-idle" in argv and env["SGLANG_USE_CPU_ENGINE"] == "1"
