"""`python -m bench.planner` (`make bench-planner`): the planner gym. Every trace (bench/planner/traces.py) at every
fleet size, scored for every static split, the oracle and the planner (bench/planner/gym.py), from the committed
capacity profile; writes bench/results/planner.json and .png, and prints the README's table and the targets:
shifting trace, planner >= 1.5x the best static split and >= 0.9x the oracle (at 32 and 128 workers); steady trace,
planner within 5% of the best static split and at most one change of split an hour (simulated)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness.machine import machine
from bench.harness.paths import RESULTS
from bench.planner import gym, plot, traces
from pdcluster.common.capacity import Profile
from planner.config import PlannerConfig
from planner.simulator import DEFAULT_FLIP_SECONDS


def targets(cells: dict[str, dict[str, dict]]) -> list[dict]:
    """Each target of the issue, per fleet size it names, with the number and whether it is met."""
    out = []
    for workers, cell in cells.get("shifting", {}).items():
        if int(workers) < 32:
            continue
        ratios = cell["ratios"]
        out.append({"target": f"shifting x{workers}: planner >= 1.5x best static", "value":
                    ratios["planner_over_best_static"], "met": (ratios["planner_over_best_static"] or 0) >= 1.5})
        out.append({"target": f"shifting x{workers}: planner >= 0.9x oracle", "value": ratios["planner_over_oracle"],
                    "met": (ratios["planner_over_oracle"] or 0) >= 0.9})
    for workers, cell in cells.get("steady", {}).items():
        if int(workers) < 32:
            continue
        ratio = cell["ratios"]["planner_over_best_static"]
        out.append({"target": f"steady x{workers}: planner >= 0.95x best static", "value": ratio,
                    "met": (ratio or 0) >= 0.95})
        per_hour = cell["planner"]["changes_per_hour"]
        out.append({"target": f"steady x{workers}: <= 1 change of split an hour", "value": per_hour,
                    "met": per_hour <= 1})
    return out


def table(result: dict) -> str:
    """The README's table: one row per trace and fleet size."""
    rows = ["| trace | workers | requests | best static | oracle | planner | planner / best static | planner / "
            "oracle | planner changes (flips) per hour |", "|" + "---|" * 9]
    for name, by_size in result["cells"].items():
        for workers, c in by_size.items():
            best, oracle, planner = c["best_static"], c["oracle"], c["planner"]
            rows.append(f"| {name} | {workers} | {c['requests']} | {best['split']} {best['goodput_per_worker']:.4f} | "
                        f"{oracle['goodput_per_worker']:.4f} | {planner['goodput_per_worker']:.4f} | "
                        f"{c['ratios']['planner_over_best_static']} | {c['ratios']['planner_over_oracle']} | "
                        f"{planner['changes_per_hour']} ({planner['flips_per_hour']}) |")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="configs/profiles/smollm2-135m-instruct.json")
    parser.add_argument("--config", default="configs/planner.yaml", help="the planner's config (its SLOs too)")
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--traces", nargs="+", default=list(traces.TRACES), choices=list(traces.TRACES))
    parser.add_argument("--hour", type=float, default=traces.HOUR, help="seconds of a simulated hour (shorter: a "
                                                                         "quick check of the harness)")
    parser.add_argument("--load", type=float, help="the shifting and steady traces' load (default 0.75 of what the "
                                                    "fleet could serve of each mix at its best split)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "planner.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    profile = Profile.load(args.profile)
    config = PlannerConfig.from_file(args.config).model_copy(update={"mode": "act"})
    began = time.monotonic()
    cells: dict[str, dict[str, dict]] = {}
    for name in args.traces:
        cells[name] = {}
        for workers in args.workers:
            load = {"load": args.load} if args.load and name != "bursts" else {}
            trace = traces.TRACES[name](profile, workers, config.itl.bound_s, args.seed, hour=args.hour, **load)
            cells[name][str(workers)] = gym.evaluate(profile, trace, workers, config, log=print)
    result = {
        "machine": machine(), "profile": args.profile, "profile_measured_at": profile.measured_at.isoformat(),
        "config": config.model_dump(), "seed": args.seed, "hour_s": args.hour, "load": args.load or "default",
        "flip_seconds": profile.flip_seconds or DEFAULT_FLIP_SECONDS,
        "flip_seconds_measured": profile.flip_seconds is not None,
        "cells": cells, "wall_s": round(time.monotonic() - began, 1),
    }
    result["targets"] = targets(cells)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot.draw(result, out.with_suffix(".png"))
    print(table(result))
    for t in result["targets"]:
        print(f"{'met' if t['met'] else 'NOT MET'}: {t['target']}: {t['value']}")
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
