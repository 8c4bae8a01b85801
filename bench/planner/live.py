"""`python -m bench.planner.live` (`make bench-planner-live`): the planner on a real cluster. One shifting trace
(prompt-heavy, answer-heavy, prompt-heavy again; open loop, seeded) through 3 SmolLM2 workers, three times in one run:
static 2P1D, static 1P2D, and the planner in `act` mode starting from 2P1D. Per run and phase: the share of requests
meeting both SLOs of configs/planner.yaml (TTFT and mean ITL within their bounds) and the workers' roles over time, so
that one can see whether the planner flipped the right way within 2 intervals of a phase change.

The planner decides every --interval seconds here (configs/planner.yaml: 60 s) so that a phase holds several
decisions; its dwell is two intervals. Writes bench/results/planner-live.json and .png."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench.harness import clusters
from bench.harness.machine import machine
from bench.harness.markdown import met
from bench.harness.paths import REPO, RESULTS
from bench.harness.plot import pyplot, save, stamp
from planner.config import PlannerConfig

VOCAB = (200, 40000)  # token ids drawn for prompts: inside SmolLM2's vocabulary, clear of its special tokens


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float  # requests per second, Poisson arrivals
    prompt_tokens: int
    answer_tokens: int


# Sized from the SmolLM2 profile (configs/profiles/): a prefill computes ~100 prompt tokens/s, so one prefill serves
# ~0.12 prompt-heavy requests/s and two ~0.25; a decode keeps ITL under 0.3 s up to ~8-12 streams, so at 0.25
# answer-heavy requests/s (~12 streams at once) one decode misses the ITL SLO and two meet it.
PHASES = (Phase("prompt-heavy", 0.16, 768, 16), Phase("answer-heavy", 0.25, 32, 160),
          Phase("prompt-heavy 2", 0.16, 768, 16))
RUNS = {"static 2P1D": (2, 1, False), "static 1P2D": (1, 2, False), "planner from 2P1D": (2, 1, True)}


def trace(seconds: float, seed: int) -> list[tuple[float, str, list[int], int]]:
    """(send at, phase, prompt ids, answer tokens), the same for every run."""
    rng, out, start = random.Random(seed), [], 0.0
    for phase in PHASES:
        t = start + rng.expovariate(phase.rate)
        while t < start + seconds:
            out.append((t, phase.name, [rng.randrange(*VOCAB) for _ in range(phase.prompt_tokens)],
                        phase.answer_tokens))
            t += rng.expovariate(phase.rate)
        start += seconds
    return out


async def one(client: httpx.AsyncClient, at: float, phase: str, ids: list[int], answer: int, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    sent, first, tokens, status = time.monotonic(), None, 0, -1
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": answer, "temperature": 0, "ignore_eos": True}}
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first = first or time.monotonic()
                tokens = json.loads(line[6:]).get("meta_info", {}).get("completion_tokens", tokens)
    except httpx.HTTPError as exc:
        status = f"{type(exc).__name__}"
    ended = time.monotonic()
    ttft = None if first is None else first - sent
    itl = None if first is None or tokens < 2 else (ended - first) / (tokens - 1)
    return {"at": round(at, 2), "phase": phase, "status": status, "ttft_s": ttft, "itl_s": itl, "tokens": tokens}


def watch_roles(bootstrap_url: str, t0: float, stop: threading.Event, into: list) -> None:
    """The registry's prefill and decode counts every 2 s (who is what: the registry says, not the start)."""
    while not stop.wait(2.0):
        try:
            workers = httpx.get(f"{bootstrap_url}/v1/workers", timeout=5).json()["workers"]
        except httpx.HTTPError:
            continue
        roles = [w["registration"]["role"] for w in workers]
        into.append((round(time.monotonic() - t0, 1), roles.count("prefill"), roles.count("decode")))


def judged(answers: list[dict], slo: PlannerConfig) -> dict:
    """Per phase and overall: requests, failures, and the share meeting both SLOs."""
    out = {}
    for name in [p.name for p in PHASES] + ["all"]:
        mine = [a for a in answers if name in ("all", a["phase"])]
        good = [a for a in mine if a["status"] == 200 and a["ttft_s"] is not None and a["ttft_s"] <= slo.ttft.bound_s
                and a["itl_s"] is not None and a["itl_s"] <= slo.itl.bound_s]
        out[name] = {"requests": len(mine), "failed": sum(a["status"] != 200 for a in mine),
                     "attainment": round(len(good) / len(mine), 3) if mine else None}
    return out


def run(name: str, args, log_dir: Path, work: list, slo: PlannerConfig) -> dict:
    prefills, decodes, with_planner = RUNS[name]
    planner_file: str | bool = False
    if with_planner:
        config = {**yaml.safe_load((REPO / "configs" / "planner.yaml").read_text()), "mode": "act",
                  "interval_s": args.interval, "dwell_s": 2 * args.interval}
        planner_file = str(log_dir / "planner.yaml")
        Path(planner_file).write_text(yaml.safe_dump(config))
    cluster = clusters.start_cluster(clusters.MODELS["smollm2"], prefills, sleep_on_idle=True,
                                     log_dir=log_dir / name.replace(" ", "-"), planner=planner_file, decodes=decodes)
    roles: list = []
    try:
        cluster.wait_ready()
        time.sleep(10)  # the router's canaries and first probes

        async def all_of_it() -> list[dict]:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(base_url=cluster.spec.router_url, timeout=600, limits=limits) as client:
                t0 = time.monotonic()
                stop = threading.Event()
                watcher = threading.Thread(target=watch_roles, args=(cluster.spec.bootstrap_url, t0, stop, roles))
                watcher.start()
                try:
                    return await asyncio.gather(*(one(client, *item, t0) for item in work))
                finally:
                    stop.set()
                    watcher.join()

        answers = asyncio.run(all_of_it())
    finally:
        cluster.stop()
    return {"run": name, "answers": answers, "roles": roles, "judged": judged(answers, slo)}


def summary(runs: list[dict], phase_s: float, interval: float) -> dict:
    """The issue's targets: the planner's attainment >= the best static run's, and a flip the right way (more decodes
    in the answer-heavy phase, more prefills after it) within 2 intervals of each phase change."""
    by_name = {r["run"]: r["judged"]["all"]["attainment"] or 0.0 for r in runs}
    best_static = max(v for k, v in by_name.items() if k.startswith("static"))
    planner = next((r for r in runs if r["run"].startswith("planner")), None)
    followed = []
    if planner:
        for change, want in ((phase_s, "decode"), (2 * phase_s, "prefill")):
            window = [(t, p, d) for t, p, d in planner["roles"] if change <= t <= change + 2 * interval + 10]
            followed.append(any((d >= 2 if want == "decode" else p >= 2) for _, p, d in window))
    planner_score = by_name.get("planner from 2P1D", 0.0)
    return {"attainment": by_name, "best_static": best_static, "planner_over_best_static":
            round(planner_score / best_static, 3) if best_static else None, "followed_each_change": followed,
            "met": bool(planner) and planner_score >= best_static and all(followed)}


def readme_line(result: dict) -> str:
    s = result["summary"]
    scores = ", ".join(f"{k} {v:.2f}" for k, v in s["attainment"].items())
    return (f"SLO attainment {scores}; each change followed within 2 intervals: {s['followed_each_change']}; "
            f"target: {met(s['met'])}.")


def draw(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (bars, roles) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [p.name for p in PHASES]
    for i, r in enumerate(result["runs"]):
        values = [r["judged"][n]["attainment"] or 0 for n in names]
        bars.bar([x + i * 0.27 for x in range(len(names))], values, width=0.27, label=r["run"])
    bars.set_xticks([x + 0.27 for x in range(len(names))], names, fontsize=8)
    bars.set_ylabel("share meeting both SLOs")
    bars.legend(fontsize=7)
    planner = next((r for r in result["runs"] if r["run"].startswith("planner")), None)
    if planner and planner["roles"]:
        t, _p, d = zip(*planner["roles"], strict=True)
        roles.step(t, d, where="post", label="decodes (planner run)")
        for k in range(1, len(PHASES)):
            roles.axvline(k * result["settings"]["phase_s"], color="grey", linestyle=":")
        roles.set_xlabel("seconds into the trace")
        roles.legend(fontsize=7)
    fig.suptitle(f"Planner live, 3 SmolLM2 workers ({stamp(result['machine'])})", fontsize=9)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner.live", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", type=float, default=120.0, help="seconds per phase")
    parser.add_argument("--interval", type=float, default=15.0, help="the planner's interval_s for this run")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "planner-live")
    args = parser.parse_args(argv)
    slo = PlannerConfig.model_validate(yaml.safe_load((REPO / "configs" / "planner.yaml").read_text()))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-planner-live-"))
    print(f"process logs in {log_dir}", flush=True)
    measured_on, began, work = machine(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), trace(args.phase,
                                                                                                    args.seed)
    runs = []
    for name in RUNS:
        runs.append(run(name, args, log_dir, work, slo))
        print(f"{name}: {runs[-1]['judged']}", flush=True)
    result = {"benchmark": "the planner live on 3 SmolLM2 workers, one shifting trace",
              "settings": {"phase_s": args.phase, "interval_s": args.interval, "seed": args.seed,
                           "phases": [p.__dict__ for p in PHASES], "requests": len(work),
                           "slo": {"ttft_s": slo.ttft.bound_s, "itl_s": slo.itl.bound_s}},
              "machine": measured_on, "started_utc": began, "runs": runs,
              "summary": summary(runs, args.phase, args.interval)}
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    draw(result, Path(f"{args.out}.png"))
    print(json.dumps(result["summary"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
