"""`python -m bench.overload` (`make bench-overload`): more load than the cluster can serve, on SmolLM2 1P+1D.

One cluster (bench/harness/clusters.py: configs/prefill.yaml and decode.yaml as `make up` runs them) and two routers
over the same two workers: ours with admission on and four tenants (ROUTER below), and SGLang's gateway
(`sglang_router.launch_router --pd-disaggregation`) with its concurrency limit and queue (PEER_FLAGS). First a
closed-loop probe through the cluster's own router (admission off) measures the capacity C for the mix
(bench/overload/load.py); then open-loop phases of PHASE seconds each:
  ours 0.5x, 1x, 2x, 4x   tenant alice alone at that multiple of C (0.5x is also her solo run)
  ours tenants            alice at 0.5 C (her share of two equal weights) and bob at 5 C (10x his share)
  ours classes            an interactive tenant and a batch tenant at 1 C each (2x together)
  sglang 1x, 2x, 4x       the same load (no key) through SGLang's gateway
During each phase of ours its /metrics is read every second: breaker openings (a worker's breaker_state going to
open), ejections and refusals. bench/overload/report.py derives goodput and the verdicts and draws the picture.
Writes bench/results/overload.json and .png (`--quick`: overload-quick). Hold
`flock /tmp/pdcluster-cluster.lock` (the Makefile target does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import clusters, cpu, machine, procs
from bench.harness.paths import REPO, RESULTS
from bench.overload import load, report
from bench.overload.load import Sender

BOUND = 3.0  # seconds: every class's bound on a new request's predicted prefill wait
QUEUE = {"queue_length": 8, "queue_wait": 1.0}  # a short queue: a refusal comes early, not after a long wait
KEYS = {"alice": "bench-overload-alice", "bob": "bench-overload-bob", "interactive": "bench-overload-chat",
        "batch": "bench-overload-bulk"}
CLASS_OF = {"alice": "default", "bob": "default", "interactive": "interactive", "batch": "batch"}
ROUTER = {
    "admission": {"enabled": True, "profile": "configs/profiles/smollm2-135m-instruct.json",
                  "classes": {"default": {"max_predicted_wait": BOUND, **QUEUE},
                              "interactive": {"priority": 10, "max_predicted_wait": BOUND, **QUEUE},
                              "batch": {"priority": 0, "max_predicted_wait": BOUND, **QUEUE}}},
    "tenants": {name: {"key_sha256": [hashlib.sha256(key.encode()).hexdigest()], "priority_class": CLASS_OF[name],
                       "weight": 1.0} for name, key in KEYS.items()},
}
# SGLang's gateway, set as ours: at most as many requests at once as the probe's clients, a queue of 8 for 1 s.
PEER_FLAGS = ("--max-concurrent-requests", "8", "--queue-size", "8", "--queue-timeout-secs", "1")


def scrape(url: str) -> dict[str, float]:
    """Our router's counters a phase reads before and after: ejections, refusals by reason, answers by status."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdcluster_router_worker_ejections_total":
                key = "ejections"
            elif s.name == "pdcluster_router_admission_refusals_total":
                key = f"refusals[{s.labels['reason']}]"
            elif s.name == "pdcluster_router_requests_total":
                key = f"answers[{s.labels['status']}]"
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


async def watch_breakers(url: str, stop: asyncio.Event) -> int:
    """Openings of any worker's breaker (its state going to 2, open) while `stop` is not set, read every second."""
    openings, last = 0, {}
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            try:
                text = (await client.get(f"{url}/metrics")).text
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.name == "pdcluster_router_breaker_state":
                            worker = s.labels.get("worker", "")
                            openings += int(s.value == 2 and last.get(worker) != 2)
                            last[worker] = s.value
            except (httpx.HTTPError, ValueError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    return openings


async def phase_of(url: str, metrics_url: str | None, senders: list[Sender], args, seed: int):
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_breakers(metrics_url, stop)) if metrics_url else None
    try:
        records, t0, _ = await load.run_phase(url, clusters.MODELS["smollm2"].served, args.vocabulary, senders,
                                              args.phase, args.drain, seed, args.max_retries)
    finally:
        stop.set()
    openings = await watcher if watcher else None
    return records, t0, openings


def ready(url: str) -> bool:
    """Our router's /ready: 200 once its workers passed admission (a refused connection: not yet)."""
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def run_phase(name: str, url: str, ours: bool, senders: list[Sender], args, seed: int, log) -> dict:
    before = scrape(url) if ours else {}
    records, t0, openings = asyncio.run(phase_of(url, url if ours else None, senders, args, seed))
    after = scrape(url) if ours else {}
    shifted = []
    for r in records:
        row = r.to_json()
        for key in ("started", "first", "last", "ended"):
            row[key] = None if row[key] is None else round(row[key] - t0, 4)
        shifted.append(row)
    metrics = {"breaker_openings": openings,
               **{k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}} if ours else {}
    phase = {"name": name, "router": "ours" if ours else "sglang", "window_s": args.phase,
             "senders": [{"label": s.label, "rate": round(s.rate, 4)} for s in senders],
             "router_metrics": metrics, "records": shifted}
    s = report.summarize(shifted, args.phase, BOUND)
    log(f"{name}: {s['sent']} sent, {s['admitted']} admitted, {s['refused']} refused (p50 {s['refusal_ms']['p50']} "
        f"ms), goodput {s['goodput_per_s']}/s, TTFT p50/p99 {s['ttft_s']['p50']}/{s['ttft_s']['p99']} s, 5xx "
        f"{s['status_5xx']}, failed after admission {s['failed_after_admission']}, breaker openings {openings}, "
        f"openai {s['openai']['served']}/{s['openai']['sent']} served; errors {s['error_samples']}")
    time.sleep(3)  # what was cancelled at the drain's end is aborted on both workers
    return phase


def save(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")


def phases(capacity: float) -> list[tuple[str, bool, list[Sender]]]:
    alice = [(f"ours {m:g}x", True, [Sender("alice", KEYS["alice"], m * capacity)]) for m in (0.5, 1, 2, 4)]
    return [*alice,
            ("ours tenants", True, [Sender("alice", KEYS["alice"], 0.5 * capacity),
                                    Sender("bob", KEYS["bob"], 5 * capacity)]),
            ("ours classes", True, [Sender("interactive", KEYS["interactive"], capacity),
                                    Sender("batch", KEYS["batch"], capacity)]),
            *[(f"sglang {m:g}x", False, [Sender("anonymous", None, m * capacity)]) for m in (1, 2, 4)]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", type=float, default=75.0, help="seconds of arrivals per phase (default 75)")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds in-flight requests get after a phase")
    parser.add_argument("--probe", type=float, default=60.0, help="measured seconds of the capacity probe")
    parser.add_argument("--probe-warmup", type=float, default=30.0)
    parser.add_argument("--probe-concurrency", type=int, default=8)
    parser.add_argument("--max-retries", type=int, default=6, help="the openai client's max_retries (default 6)")
    parser.add_argument("--no-peer", action="store_true", help="skip SGLang's gateway")
    parser.add_argument("--quick", action="store_true", help="a ~6 minute smoke run of the harness")
    parser.add_argument("--out", default=None, help="results path without extension")
    args = parser.parse_args(argv)
    if args.quick:
        args.phase, args.drain, args.probe, args.probe_warmup = 15.0, 20.0, 20.0, 10.0
    out = Path(args.out) if args.out else RESULTS / ("overload-quick" if args.quick else "overload")
    began, t_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.monotonic()
    measured_on = {**machine.machine(), "cores_busy_before_start": round(cpu.busy_cores(2.0), 3)}

    def log(line: str) -> None:
        print(f"bench.overload [{time.monotonic() - t_start:5.0f} s] {line}", flush=True)

    result: dict = {"started_utc": began, "machine": measured_on,
                    "settings": {"phase_s": args.phase, "drain_s": args.drain, "bound_s": BOUND, "queue": QUEUE,
                                 "max_retries": args.max_retries, "mix": load.MIX, "openai_every": load.OPENAI_EVERY,
                                 "router": {k: v for k, v in ROUTER.items() if k != "tenants"},
                                 "peer_flags": None if args.no_peer else list(PEER_FLAGS), "quick": args.quick},
                    "phases": []}
    logs = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    log(f"logs in {logs}")
    model = clusters.MODELS["smollm2"]
    args.vocabulary = load.words(REPO / model.path)
    cluster = clusters.start_cluster(model, 1, sleep_on_idle=True, log_dir=logs / "cluster")
    stop: list = [cluster]
    try:
        cluster.wait_ready()
        prefills, decodes = clusters.workers(cluster, "prefill"), clusters.workers(cluster, "decode")
        ours = procs.start_ours("router_ours", logs, prefills, decodes, settings=ROUTER)
        stop.append(ours)
        procs.wait_ready(ours, lambda: ready(ours.url), 300)
        peer = None if args.no_peer else procs.start_sglang(logs, prefills, decodes[0], extra=PEER_FLAGS)
        if peer:
            stop.append(peer)
        log(f"capacity probe: {args.probe_concurrency} closed-loop clients through the cluster's router")
        capacity = asyncio.run(load.probe(cluster.router_url, model.served, args.vocabulary, args.probe_concurrency,
                                          args.probe_warmup, args.probe, seed=1))
        log(f"capacity: {capacity['requests_per_s']} requests/s ({capacity['completed']} completed, "
            f"{capacity['errors']} errors {capacity['error_samples']})")
        if capacity["requests_per_s"] <= 0:
            raise SystemExit("bench.overload: the probe completed nothing; see the logs")
        if peer:
            try:
                procs.wait_ready(peer, lambda: procs.request(peer.port, "GET", "/health")[0] == 200, 120)
            except (RuntimeError, TimeoutError) as exc:  # ours is still measured; the results say why not the peer
                result["peer_failed"] = str(exc)
                peer.stop()
                peer = None
        result["capacity"] = capacity
        for seed, (name, is_ours, senders) in enumerate(phases(capacity["requests_per_s"])):
            if not is_ours and peer is None:
                continue
            result["phases"].append(run_phase(name, ours.url if is_ours else peer.url, is_ours, senders, args, seed,
                                              log))
            save(result, out)  # a run that stops later keeps what it measured (report.py derives it again)
    finally:
        for thing in reversed(stop):
            thing.stop()
    result["wall_seconds"] = round(time.monotonic() - t_start)
    result["derived"] = report.derive(result)
    save(result, out)
    report.draw(result, Path(f"{out}.png"))
    print(report.table(result) + "\n\n" + report.verdict_table(result))
    log(f"wrote {out}.json and .png")


if __name__ == "__main__":
    main()
