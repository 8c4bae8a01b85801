"""bench.overload's results: each phase's goodput, TTFT, refusals, failures and the openai client's fate, the verdicts
against the targets of shedding load, the picture, and the Markdown tables bench/README.md shows.

A request meets the SLO when it was admitted, streamed its whole answer, its TTFT is within the class's bound on the
predicted wait plus its own prefill at the slowest rate the capacity profile measured (PREFILL_RATE), and its mean
inter-token latency is within SLO_ITL_S. Goodput and TTFT are of the plain (httpx) requests, each tried once; the
openai client's requests (every fourth) are judged apart: served or not, after how many answers, how late.

`python -m bench.overload.report [bench/results/overload.json]` derives again (into the file), draws and prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.harness import plot
from bench.harness.markdown import grid, load, met, num, source
from bench.harness.stats import percentile

PREFILL_RATE = 80.0  # prompt tokens/s: the slowest prefill point of configs/profiles/smollm2-135m-instruct.json
SLO_ITL_S = 0.4  # about 4x the profile's decode step for one stream, 1.4x its step at a batch of 16
SLICES = 3  # goodput per third of a phase: its noise within the run
REFUSAL_TARGET_MS = 50.0


def _pct(values: list[float], q: float, scale: float = 1.0, digits: int = 1) -> float | None:
    return round(scale * percentile(values, q), digits) if values else None


def _itl(r: dict) -> float | None:
    if r["first"] is None or r["last"] is None or r["answer"] < 2:
        return None
    return (r["last"] - r["first"]) / (r["answer"] - 1)


def meets_slo(r: dict, bound: float) -> bool:
    if r["status"] != 200 or r["error"] or not r["completed"] or r["first"] is None:
        return False
    itl = _itl(r)
    return r["first"] - r["started"] <= bound + r["prompt"] / PREFILL_RATE and (itl is None or itl <= SLO_ITL_S)


def summarize(records: list[dict], window: float, bound: float) -> dict:
    """One phase's (or one sender's) numbers; times in the records are seconds from the phase's start."""
    plain = [r for r in records if r["client"] == "httpx"]
    admitted = [r for r in plain if r["status"] == 200]
    refused = [r for r in plain if r["status"] == 429]
    ttft = [r["first"] - r["started"] for r in admitted if r["first"] is not None]
    excess = [r["first"] - r["started"] - r["prompt"] / PREFILL_RATE for r in admitted if r["first"] is not None]
    itl = [v for v in map(_itl, admitted) if v is not None]
    good = [r for r in plain if meets_slo(r, bound)]
    slices = [sum(1 for r in good if k * window / SLICES <= r["started"] < (k + 1) * window / SLICES)
              / (window / SLICES) for k in range(SLICES)]
    oa = [r for r in records if r["client"] == "openai"]
    served = [r for r in oa if r["status"] == 200 and r["completed"] and not r["error"]]
    retry_after = [float(r["retry_after"]) for r in refused if r["retry_after"]]
    return {
        "sent": len(plain), "offered_per_s": round(len(plain) / window, 3),
        "admitted": len(admitted), "admitted_per_s": round(len(admitted) / window, 3), "refused": len(refused),
        "goodput_per_s": round(len(good) / window, 4), "goodput_slices": [round(s, 4) for s in slices],
        "ttft_s": {"p50": _pct(ttft, 50, digits=2), "p99": _pct(ttft, 99, digits=2), "n": len(ttft)},
        "ttft_over_own_prefill_p99_s": _pct(excess, 99, digits=2),
        "itl_ms": {"p50": _pct(itl, 50, 1000), "p99": _pct(itl, 99, 1000)},
        "refusal_ms": {"p50": _pct([r["ended"] - r["started"] for r in refused], 50, 1000),
                       "p99": _pct([r["ended"] - r["started"] for r in refused], 99, 1000)},
        "retry_after_s": {"p50": _pct(retry_after, 50), "max": max(retry_after, default=None),
                          "missing": sum(1 for r in refused if not r["retry_after"])},
        "status_5xx": sum(1 for r in records if (r["status"] or 0) >= 500),
        "failed_after_admission": sum(1 for r in admitted if r["error"] and not r["error"].startswith("cancelled")),
        "other_failures": sum(1 for r in plain if r["status"] not in (200, 429) and (r["status"] or 0) < 500),
        "unanswered_at_drain_end": sum(1 for r in records if (r["error"] or "").startswith("cancelled")),
        "error_samples": sorted({r["error"] for r in records if r["error"] and r["status"] != 429})[:3],
        "openai": {"sent": len(oa), "served": len(served),
                   "attempts_mean": round(sum(r["attempts"] for r in oa) / len(oa), 2) if oa else None,
                   "attempts_max": max((r["attempts"] for r in oa), default=None),
                   "ttft_s": {"p50": _pct([r["first"] - r["started"] for r in served], 50, digits=2),
                              "p99": _pct([r["first"] - r["started"] for r in served], 99, digits=2)}},
    }


def derive(result: dict) -> dict:
    """Per phase its summary (all senders and each); the verdicts against the targets."""
    bound = result["settings"]["bound_s"]
    phases = {}
    for phase in result["phases"]:
        records, window = phase["records"], phase["window_s"]
        row = {"all": summarize(records, window, bound)}
        labels = sorted({r["sender"] for r in records})
        if len(labels) > 1:
            row.update({label: summarize([r for r in records if r["sender"] == label], window, bound)
                        for label in labels})
        row["router"] = phase.get("router_metrics", {})
        phases[phase["name"]] = row
    return {"phases": phases, "verdicts": verdicts(phases, result)}


def _v(value, target: str, ok: bool) -> dict:
    return {"value": value, "target": target, "pass": bool(ok)}


def verdicts(phases: dict, result: dict) -> dict:
    out: dict[str, dict] = {}
    bound = result["settings"]["bound_s"]
    base = phases.get("ours 1x", {}).get("all", {}).get("goodput_per_s")
    for name in ("ours 2x", "ours 4x"):
        if name not in phases:
            continue
        s, router = phases[name]["all"], phases[name]["router"]
        out[f"{name}: 5xx"] = _v(s["status_5xx"], "0", s["status_5xx"] == 0)
        out[f"{name}: breaker openings"] = _v(router.get("breaker_openings"), "0", router.get("breaker_openings") == 0)
        out[f"{name}: failed after admission"] = _v(s["failed_after_admission"], "0", s["failed_after_admission"] == 0)
        ratio = round(s["goodput_per_s"] / base, 3) if base else None
        out[f"{name}: goodput / 1x's"] = _v(ratio, ">= 0.9", ratio is not None and ratio >= 0.9)
        excess = s["ttft_over_own_prefill_p99_s"]
        out[f"{name}: admitted TTFT p99 less own prefill"] = _v(excess, f"<= {bound:g} s (the bound)",
                                                               excess is not None and excess <= bound)
        p99 = s["refusal_ms"]["p99"]  # none refused: nothing was late
        out[f"{name}: refusal p99 ms"] = _v(p99, f"<= {REFUSAL_TARGET_MS:g}", p99 is None or p99 <= REFUSAL_TARGET_MS)
        oa = s["openai"]
        out[f"{name}: openai client served"] = _v(f"{oa['served']}/{oa['sent']}", "all", oa["served"] == oa["sent"])
    if "ours tenants" in phases and "ours 0.5x" in phases:
        solo = phases["ours 0.5x"]["all"]["ttft_s"]["p99"]
        mix = phases["ours tenants"]
        other = mix.get("alice", {}).get("ttft_s", {}).get("p99")
        ratio = round(other / solo, 2) if other and solo else None
        out["tenants: alice's TTFT p99 / her solo run's"] = _v(ratio, "<= 1.5", ratio is not None and ratio <= 1.5)
        share = result["capacity"]["requests_per_s"] / 2
        got = mix.get("bob", {}).get("admitted_per_s")
        out["tenants: bob (10x his share) admitted / his share"] = _v(
            round(got / share, 2) if got and share else None, ">= 0.8", bool(got and share and got / share >= 0.8))
    if "ours classes" in phases:
        chat = phases["ours classes"].get("interactive", {}).get("ttft_s", {}).get("p50")
        bulk = phases["ours classes"].get("batch", {}).get("ttft_s", {}).get("p50")
        ratio = round(chat / bulk, 2) if chat and bulk else None
        out["classes at 2x: interactive TTFT p50 / batch's"] = _v(ratio, "<= 0.5", ratio is not None and ratio <= 0.5)
    return out


HEADER = ["phase", "offered/s", "admitted/s", "goodput/s (thirds)", "TTFT p50/p99 s", "refusal p50/p99 ms",
          "Retry-After p50 s", "5xx", "failed after admission (+unanswered)",
          "breaker openings", "openai client: served, attempts"]


def _row(name: str, s: dict, router: dict) -> list[str]:
    oa = s["openai"]
    return [name, num(s["offered_per_s"]), num(s["admitted_per_s"]),
            f"{num(s['goodput_per_s'], 3)} ({num(min(s['goodput_slices']), 3)}-{num(max(s['goodput_slices']), 3)})",
            f"{num(s['ttft_s']['p50'])}/{num(s['ttft_s']['p99'])}",
            f"{num(s['refusal_ms']['p50'], 0)}/{num(s['refusal_ms']['p99'], 0)}", num(s["retry_after_s"]["p50"], 0),
            str(s["status_5xx"]), f"{s['failed_after_admission']} (+{s['unanswered_at_drain_end']})",
            str(router.get("breaker_openings", "-")),
            f"{oa['served']}/{oa['sent']}, {num(oa['attempts_mean'], 1)}"]


def table(result: dict) -> str:
    derived, rows = result["derived"], []
    for name, row in derived["phases"].items():
        rows.append(_row(name, row["all"], row["router"]))
        rows += [_row(f"{name}: {label}", s, {}) for label, s in row.items() if label not in ("all", "router")]
    s = result["settings"]
    head = (f"capacity {result['capacity']['requests_per_s']:.3f} requests/s (closed loop, "
            f"{result['capacity']['concurrency']} clients); phases of {s['phase_s']:g} s, one run; bound "
            f"{s['bound_s']:g} s, ITL SLO {1000 * SLO_ITL_S:g} ms:\n\n")
    return head + grid(HEADER, rows)


def verdict_table(result: dict) -> str:
    rows = [[name, str(v["value"]), v["target"], met(v["pass"])] for name, v in result["derived"]["verdicts"].items()]
    return grid(["target", "value", "wanted", ""], rows)


def readme_verdicts(result: dict) -> str:
    verdicts = result["derived"]["verdicts"]
    missed = [f"{name} {v['value']} (wanted {v['target']})" for name, v in verdicts.items() if not v["pass"]]
    return (f"Targets met: {sum(v['pass'] for v in verdicts.values())} of {len(verdicts)}. **Not met**: "
            + ("; ".join(missed) or "none") + ".")


README_HEADER = ["phase", "offered/admitted/goodput per s", "TTFT p50/p99 s", "refusal p50/p99 ms",
                 "5xx/failed/unanswered/breaker openings", "openai client served (attempts)"]


def _readme_row(name: str, s: dict, router: dict) -> list[str]:
    oa = s["openai"]
    return [name, f"{num(s['offered_per_s'])}/{num(s['admitted_per_s'])}/{num(s['goodput_per_s'], 3)}",
            f"{num(s['ttft_s']['p50'], 1)}/{num(s['ttft_s']['p99'], 1)}",
            f"{num(s['refusal_ms']['p50'], 0)}/{num(s['refusal_ms']['p99'], 0)}",
            f"{s['status_5xx']}/{s['failed_after_admission']}/{s['unanswered_at_drain_end']}/"
            f"{router.get('breaker_openings', '-')}", f"{oa['served']}/{oa['sent']} ({num(oa['attempts_mean'], 1)})"]


def readme_table(name: str = "overload.json") -> str:
    """Each phase's row, and alice's in the tenants phase (the flooder's is about the phase's; the classes' ratio is in
    the verdicts)."""
    result = load(name)
    rows = []
    for phase, row in result["derived"]["phases"].items():
        rows.append(_readme_row(phase, row["all"], row["router"]))
        if "alice" in row:
            rows.append(_readme_row(f"{phase}: alice", row["alice"], {}))
    c, s = result["capacity"], result["settings"]
    verdicts = result["derived"]["verdicts"].values()
    return (f"{source(result, name)} C = {c['requests_per_s']:.2f}/s, phases of {s['phase_s']:g} s, one run; targets "
            f"met: {sum(v['pass'] for v in verdicts)} of {len(verdicts)}\n\n"
            f"{grid(README_HEADER, rows)}")


def draw(result: dict, path: Path) -> None:
    plt = plot.pyplot()
    phases = result["derived"]["phases"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for router, marker in (("ours", "o-"), ("sglang", "s--")):
        names = [n for n in phases if n.startswith(f"{router} ") and n.endswith("x")]
        xs = [float(n.split()[-1][:-1]) for n in names]
        for ax, key in zip(axes, ("goodput_per_s", "ttft_p99", "refusal_p99"), strict=True):
            ys = [phases[n]["all"]["goodput_per_s"] if key == "goodput_per_s" else
                  phases[n]["all"]["ttft_s"]["p99"] if key == "ttft_p99" else phases[n]["all"]["refusal_ms"]["p99"]
                  for n in names]
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker, label=router)
    for ax, title in zip(axes, ("goodput (requests meeting the SLO)/s", "admitted TTFT p99 (s)",
                                "refusal latency p99 (ms)"), strict=True):
        ax.set_xlabel("offered load (x measured capacity)")
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"bench.overload, SmolLM2 1P+1D: {plot.stamp(result['machine'])}")
    plot.save(fig, path)


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "results" / "overload.json"
    result = json.loads(path.read_text())
    result["derived"] = derive(result)
    path.write_text(json.dumps(result, indent=1) + "\n")
    draw(result, path.with_suffix(".png"))
    print(table(result) + "\n\n" + verdict_table(result))


if __name__ == "__main__":
    main(sys.argv[1:])
