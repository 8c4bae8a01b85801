"""One trace at one fleet size: every static split (at 128 workers a coarse scan, then every split around the best
one found), the oracle (each phase's best static split, found on that phase alone, from the phase's start, changing
through the same drains and flips as the planner) and the planner (from an even split, deciding each interval in
mode act), each summarised."""

from __future__ import annotations

import statistics
import time

from pdcluster.common.capacity import Profile
from planner.config import PlannerConfig
from planner.sim_policies import Oracle, PlannerPolicy, Static
from planner.simulator import Phase, RunResult, Simulator, Trace
from planner.sizing import Split

FULL_SCAN_UP_TO = 32  # fleets up to this size try every static split; larger ones scan in steps, then refine


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(result: RunResult, duration: float, seconds: float) -> dict:
    ttfts = [r.ttft for r in result.requests if r.ttft is not None]
    itls = [r.mean_itl for r in result.requests if r.mean_itl is not None]
    hours = duration / 3600
    return {
        "policy": result.policy, "goodput_per_worker": round(result.goodput, 6),
        "phase_goodput_per_worker": {k: round(v, 6) for k, v in result.phase_goodput.items()},
        "requests": len(result.requests), "good_share": round(sum(result.good) / max(1, len(result.good)), 4),
        "unfinished": sum(r.done is None for r in result.requests),
        "ttft_s": {"p50": _r(pct(ttfts, 50)), "p90": _r(pct(ttfts, 90))},
        "itl_s": {"p50": _r(pct(itls, 50), 4), "p90": _r(pct(itls, 90), 4)},
        "changes": result.changes, "flips": result.flips, "changes_per_hour": round(result.changes / hours, 2),
        "flips_per_hour": round(result.flips / hours, 2), "splits": result.splits, "sim_seconds": round(seconds, 1),
    }


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def scan(sim: Simulator, trace: Trace, workers: int) -> dict[int, dict]:
    """Static splits of `trace` by prefill count: every one up to FULL_SCAN_UP_TO workers; beyond, every
    workers/16-th, then every split around the best of those."""
    static: dict[int, dict] = {}

    def run(prefills: int) -> None:
        if 1 <= prefills < workers and prefills not in static:
            began = time.monotonic()
            result = sim.run(trace, Static(Split(prefills, workers - prefills)))
            static[prefills] = summary(result, trace.duration, time.monotonic() - began)

    step = 1 if workers <= FULL_SCAN_UP_TO else workers // 16
    for prefills in [*range(1, workers, step), workers - 1]:
        run(prefills)
    best = _best(static)
    for prefills in range(best - step + 1, best + step):
        run(prefills)
    return static


def phase_alone(trace: Trace, phase: Phase) -> Trace:
    """The requests of one phase, on a fleet that starts it empty (no backlog from the phase before)."""
    requests = tuple((t - phase.start, p, a) for t, p, a in trace.requests if phase.start <= t < phase.end)
    length = phase.end - phase.start
    return Trace(f"{trace.name}/{phase.name}", requests, length, (Phase(phase.name, 0.0, length),))


def evaluate(profile: Profile, trace: Trace, workers: int, config: PlannerConfig, log) -> dict:
    sim = Simulator(profile, workers, config.ttft.bound_s, config.itl.bound_s)
    static = scan(sim, trace, workers)
    best = _best(static)
    # The oracle's splits: each phase's best, scanned on the phase alone; in the whole trace's static runs a phase
    # inherits the backlog a bad split left in the phase before, which would blame it on the split.
    phase_best = {phase.name: _best(scan(sim, phase_alone(trace, phase), workers)) for phase in trace.phases}
    log(f"  {trace.name} x{workers}: {len(static)} static splits, {len(trace.requests)} requests each; each phase's "
        f"best alone: {', '.join(f'{k} {_split(workers, v)}' for k, v in phase_best.items())}")
    schedule = [(phase.start, _split(workers, phase_best[phase.name])) for phase in trace.phases]
    began = time.monotonic()
    oracle = summary(sim.run(trace, Oracle(schedule)), trace.duration, time.monotonic() - began)
    planner_policy = PlannerPolicy(config, profile, start=Split(workers // 2, workers - workers // 2))
    began = time.monotonic()
    planner = summary(sim.run(trace, planner_policy), trace.duration, time.monotonic() - began)
    planner["decisions"] = [d.log_line() for d in planner_policy.decisions if d.changes][:50]
    out = {
        "workers": workers, "requests": len(trace.requests),
        "static": {str(_split(workers, p)): s["goodput_per_worker"] for p, s in sorted(static.items())},
        "best_static": static[best] | {"split": str(_split(workers, best))},
        "oracle": oracle | {"schedule": [(t, str(s)) for t, s in schedule]},
        "planner": planner,
    }
    out["ratios"] = {"planner_over_best_static": _ratio(planner, static[best]),
                     "planner_over_oracle": _ratio(planner, oracle)}
    log(f"  {trace.name} x{workers}: best static {out['best_static']['split']} "
        f"{static[best]['goodput_per_worker']:.4f}, oracle {oracle['goodput_per_worker']:.4f}, planner "
        f"{planner['goodput_per_worker']:.4f} ({planner['changes']} changes, {planner['flips']} flips)")
    return out


def _best(static: dict[int, dict]) -> int:
    return max(sorted(static), key=lambda prefills: static[prefills]["goodput_per_worker"])


def _split(workers: int, prefills: int) -> Split:
    return Split(prefills, workers - prefills)


def _ratio(a: dict, b: dict) -> float | None:
    return None if not b["goodput_per_worker"] else round(a["goodput_per_worker"] / b["goodput_per_worker"], 3)


def median_ratio(cells: list[dict], key: str) -> float | None:
    values = [c["ratios"][key] for c in cells if c["ratios"][key] is not None]
    return round(statistics.median(values), 3) if values else None
