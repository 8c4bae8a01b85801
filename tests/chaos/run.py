"""`make chaos`: a local cluster of 2 prefills + 2 decodes under a steady mixed load, while faults are injected one
at a time; every request must end as a right answer or a clear error, every fault must heal on its own within its
limit, and at the end every worker must be back, registered, healthy, with its KV cache drained to its idle level.

    python -m tests.chaos [--clients 6] [--steady 60] [--faults all] [--out tests/chaos/results/chaos]

Load: `--clients` threads, each sending one request at a time through the router (a new connection each: no
keep-alive races to muddy the verdict): /generate and /v1/completions, streamed or not, prompts of ~5 to ~1800
tokens, 8/16/32 new tokens, temperature 0. Every answer is checked against plain `transformers`
(tests/e2e/reference.py; prompts whose reference has a near-tie in the first 32 tokens are not used).

Each request ends as exactly one of:
- ok: 200 and the reference's tokens (streams: ending in `data: [DONE]`);
- error: a clear error: a JSON 4xx/5xx, or an SSE error event; `refused` (connection refused while the router
  restarts: the client knows nothing was sent) is counted apart;
- defect: anything else: a hang past the deadline, a stream that ends with neither an error nor [DONE], malformed
  JSON, wrong tokens, a 200 whose finish_reason is "abort", a connection cut mid-answer.

Faults (in this order; `--faults` picks some): SIGSTOP of a decode's whole process tree and of a prefill's (15 s,
then SIGCONT), SIGSTOP of a decode's scheduler alone (its HTTP side answers: a stuck scheduler), kill -9 of a
decode's SGLang and of a prefill's (the local cluster's supervisor restarts them),
a restart of the bootstrap service and of the router (SIGTERM, not through the cluster: the supervisor restarts
them), and with `--network` a network fault between the prefills and a decode (iptables drops the decode's
Mooncake port for 15 s). Each has a time limit for detection (a hang: 10 s) and for recovery.

Writes <out>.json (summary, every fault with its timings, defects and a sample of errors, probe latencies, KV
usage) and <out>.png (requests/s, errors and defects over time, the faults marked). Exit status 1 if any
requirement failed. The probe measurements behind the router's liveness thresholds come from the same run
(docs/faults.md).

Modules of tests/chaos/: cluster.py (the cluster, the limits, "is every worker serving?"), load.py (the clients and
the verdict on every answer), probes.py (/v1/loads and /health timings), faults.py (the faults and their timings),
report.py (summary, JSON, picture); this file runs them. A soak, not a pytest suite: no file here is named test_*,
and tests/conftest.py keeps pytest out of this folder.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pdcluster.local.cluster import LocalCluster
from tests.chaos.cluster import ALL_FAULTS, DEADLINE, SIZES, all_serving, chaos_spec, registered
from tests.chaos.faults import Chaos, clean_iptables
from tests.chaos.load import Load, build_prompts
from tests.chaos.probes import Probes
from tests.chaos.report import draw, dump, summarize, timeline
from tests.e2e.reference import ReferenceModel
from tests.helpers import seconds_until, used_tokens, worker_url

REPO = Path(__file__).resolve().parents[2]  # runs from the checkout (`python -m tests.chaos`)
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of load before the first fault")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of load between faults")
    parser.add_argument("--faults", default="all", help="comma-separated, from: " + ", ".join(ALL_FAULTS)
                        + "; 'all' or 'none'")
    parser.add_argument("--network", action="store_true", help="also: drop decode-0's Mooncake port (iptables)")
    parser.add_argument("--max-minutes", type=float, default=30.0, help="skip faults not started by then")
    parser.add_argument("--port-base", type=int, default=38000, help="router; +998 bootstrap, +100 prefills, "
                        "+200 decodes")
    parser.add_argument("--kv-port-base", type=int, default=39500)
    parser.add_argument("--prompts-per-size", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "chaos"), help="writes OUT.json, OUT.png")
    args = parser.parse_args(argv)

    faults = [] if args.faults == "none" else ALL_FAULTS if args.faults == "all" else [
        f.strip() for f in args.faults.split(",") if f.strip()]
    for fault in faults:
        if fault not in ALL_FAULTS:
            parser.error(f"unknown fault {fault!r}")
    if args.network:
        faults.insert(2 if len(faults) >= 2 else len(faults), "network decode-0")
    began_wall = time.time()
    t_start = time.monotonic()

    def log(line: str) -> None:
        print(f"[chaos {time.monotonic() - t_start:6.0f}s] {line}", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = REPO / "logs" / "chaos"  # git-ignored; one file per component, appended across restarts
    spec = chaos_spec(args.port_base, args.kv_port_base)
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(f"{time.monotonic() - t_start:.1f}s {line}")
        log(f"supervisor: {line.splitlines()[0]}")

    cluster = LocalCluster(spec, log_dir, report=report)
    log("building the reference answers ...")
    reference = ReferenceModel(str(REPO / "models" / "tiny-llama"))
    prompts = build_prompts(reference, args.prompts_per_size, args.seed)
    log(f"{len(prompts)} prompts ({', '.join(f'{s} ~{n}' for s, n in SIZES.items())} tokens); starting a 2P+2D "
        f"cluster (logs in {log_dir}) ...")
    if args.network:
        clean_iptables()
    cluster.start()
    cluster.supervise()  # from the start: a worker that dies while starting is restarted too
    load = probes = chaos = None
    verdicts: list[str] = []
    try:
        started = seconds_until(lambda: all_serving(cluster), cluster.spec.ready_timeout, 1.0)
        if started is None:
            raise TimeoutError(f"the cluster did not get ready within {cluster.spec.ready_timeout:.0f}s")
        log(f"ready after {started:.0f}s")
        names = [*(f"prefill-{i}" for i in range(2)), *(f"decode-{i}" for i in range(2))]
        baseline = {n: used_tokens(worker_url(cluster, n)) for n in names}
        restarts_at_ready = cluster.restarts()
        load = Load(cluster.router_url, prompts, reference.tokenizer, args.clients, args.seed)
        probes = Probes(cluster, load)
        load.start()
        probes.start()
        probes.heavy.set()
        log(f"steady load: {args.clients} clients for {args.steady:.0f}s")
        time.sleep(args.steady)
        steady_end = load.now()
        chaos = Chaos(cluster, load, probes, log)
        for fault in faults:
            if time.monotonic() - t_start > args.max_minutes * 60:
                verdicts.append(f"fault {fault} not run: past --max-minutes")
                continue
            if seconds_until(lambda: all_serving(cluster), 120) is None:
                verdicts.append(f"before {fault}: not every worker serving")
            time.sleep(args.settle)
            chaos.run(fault)
        time.sleep(args.settle)
        log("stopping the load ...")
        load.finish()
        probes.stop.set()
        # The end: every worker registered and healthy, and its KV back at its idle level.
        end_ready = seconds_until(lambda: all_serving(cluster) and registered(cluster) == 4, 300)
        kv_after = {}
        drained = seconds_until(lambda: all(kv_after.update({n: used_tokens(worker_url(cluster, n))}) or
                                       kv_after[n] <= baseline[n] for n in names), 60, 1.0)
        kv = {"baseline": baseline, "after": kv_after, "drained_s": None if drained is None else round(drained, 1)}
    except BaseException as exc:
        log(f"run aborted: {type(exc).__name__}: {exc}")
        verdicts.append(f"run aborted: {type(exc).__name__}: {exc}")
        end_ready, kv, steady_end, restarts_at_ready = None, {}, 0.0, {}
        if load is not None:
            load.finish()
        if probes is not None:
            probes.stop.set()
    finally:
        if args.network:
            clean_iptables()
        codes = cluster.stop(timeout=60)
    records = load.records if load else []
    summary = summarize(records)
    fault_results = [asdict(r) for r in (chaos.results if chaos else [])]
    if summary.get("defect"):
        verdicts.append(f"{summary['defect']} defects")
    for r in fault_results:
        if not r["ok"]:
            verdicts.append(f"fault {r['name']}: detected {r['detected_s']} s (limit {r['limit_detect_s']}), "
                            f"recovered {r['recovered_s']} s (limit {r['limit_recover_s']}) {r['notes']}")
    if load is not None and end_ready is None:
        verdicts.append("at the end, not every worker was registered and healthy")
    if kv and kv.get("drained_s") is None:
        verdicts.append(f"KV usage not back at its idle level: {kv}")
    result = {
        "what": "tests/chaos: faults one at a time under load on a local 2P+2D cluster (CPU, tiny-llama)",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(began_wall)),
        "duration_s": round(time.monotonic() - t_start),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": [round(x, 1) for x in os.getloadavg()]},
        "load": {"clients": args.clients, "routes": ["/generate", "/v1/completions"], "stream": "half",
                 "prompt_tokens": SIZES, "max_new_tokens": [8, 16, 32], "deadline_s": DEADLINE,
                 "prompts": len(prompts)},
        "passed": not verdicts,
        "verdicts": verdicts,
        "summary": summary,
        "faults": fault_results,
        "kv_used_tokens": kv,
        "restarts": {"at_ready": restarts_at_ready, "total": cluster.restarts()},
        "supervisor_lines": [line.splitlines()[0] for line in lines],
        "exit_codes": codes,
        "probes": {"steady": probes.summary(0, steady_end) if probes else {},
                   "whole_run_outside_fault_windows": probes.summary() if probes else {}},
        "defects": [asdict(r) for r in records if r.outcome == "defect"],
        "requests_columns": ["client", "started", "ended", "route", "stream", "size", "max_new", "outcome"],
        "requests": [[r.client, round(r.started, 2), round(r.ended, 2), r.route, r.stream, r.size, r.max_new,
                      r.outcome] for r in records],
        "errors": [asdict(r) for r in records if r.outcome in ("error", "refused")][:200],
        "timeline": timeline(records),
    }
    Path(f"{out}.json").write_text(dump(result))
    try:
        draw(result, Path(f"{out}.png"))
    except Exception as exc:  # the JSON is the result; the picture is a view of it
        log(f"no picture: {exc}")
    log(f"{summary.get('requests', 0)} requests: {summary.get('ok', 0)} ok, {summary.get('error', 0)} clear errors, "
        f"{summary.get('refused', 0)} refused, {summary.get('defect', 0)} defects; "
        f"{'PASSED' if not verdicts else 'FAILED: ' + '; '.join(verdicts)}")
    log(f"wrote {out}.json and {out}.png")
    return 0 if not verdicts else 1


if __name__ == "__main__":
    sys.exit(main())
