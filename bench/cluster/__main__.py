"""`python -m bench.cluster` (`make bench-cluster`): serving performance of real clusters on the CPU demo model (or
`--model smollm2`: SmolLM2-135M-Instruct, what `make up` serves), with SGLang's own benchmark (sglang.bench_serving),
in alternating order with repeats:

  ours        PD (1 prefill + 1 decode) through our router;
  ours-twin   the same again, a second identical router process: the A/A control that measures the noise;
  sglang      the same two workers through SGLang's Rust router in PD mode (sglang-router);
  colocated   one plain SGLang server (no PD) on the same machine, same CPU profile and KV pool size;
  prefix / round_robin   our router over 2 prefills + the decode with each prefill policy, on shared-prefix data;
  busy-poll   the `ours` loads again on a cluster with sleep-on-idle off (its own session: idle schedulers that
              busy-poll would steal the CPU of every other target).

Also the idle CPU of each cluster (sleep-on-idle on and off). Writes bench/results/cluster.json and cluster.png
(cluster-smollm2.* with --model smollm2; `--quick`: a small run for development, cluster-quick*.json/.png;
`--decode-only`: bench/cluster/decode_only.py). Hold
`flock /tmp/pdcluster-cluster.lock` while it runs (the Makefile target does). Details: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.cluster import plot, report
from bench.harness import clusters, cpu, machine, procs, serving
from bench.harness.paths import REPO, RESULTS

# The SLO behind goodput (a request counts if its first token came within TTFT and every later one within TPOT on
# average) is the model's: clusters.MODELS.
CONCURRENCY = 6
LOCAL_SHAPE = ["bootstrap", "router", "prefill-0", "decode-0"]  # configs/local.yaml: what `make up` starts
BUSY_POLL_LOADS = ("random", "serial")  # what the sleep-on-idle off session runs
WARM_UP = serving.random_ids("warm-up", 8, rate=None, concurrency=4)


def loads(quick: bool, busy_poll: bool = False,
          full: tuple[int, int, int] = (120, 36, 40)) -> dict[str, serving.Workload]:
    """Runs are long enough that their start and end (ramp-up, the last request alone) do not decide a run's rate:
    with 40 random prompts a colocated run lasted 1.2-2 s and its repeats spread 61%. The busy-poll session keeps
    the short counts: at ~1 request/s there they already take 30-40 s. `full`: a full run's (random prompts, serial
    prompts, prefix groups), the model's (clusters.BenchModel.prompts)."""
    random_n, serial_n, groups = (12, 6, 6) if quick else (40, 12, 40) if busy_poll else full
    return {
        # The comparison load: a closed loop of 6 requests in flight, more than a PD pair on 2 cores keeps up with
        # (~5-6 requests/s here), so throughput is each target's capacity and latency includes its queueing.
        "random": serving.random_ids("random", random_n, rate=None, concurrency=CONCURRENCY,
                                     notes=f"random ids, 256 in / 32 out, {CONCURRENCY} in flight"),
        # One request at a time: TTFT is then prefill + KV hand-off + first decode step, with every scheduler idle
        # in between (where sleep-on-idle could delay the hand-off).
        "serial": serving.random_ids("serial", serial_n, rate=None, concurrency=1,
                                     notes="one at a time, 256 in / 32 out"),
        # Many prefixes, two requests each: what decides the cached tokens is how often a prefix's second request
        # finds the first one's prefill. Prefix affinity sends it there; round robin does half the time, a coin
        # flip per prefix, so the more prefixes the less a run's ratio depends on luck. (With few groups of many
        # requests, both miss each prefix about once per prefill and barely differ.)
        "shared-prefix": serving.shared_prefix("shared-prefix", groups=groups, per_group=2, concurrency=CONCURRENCY,
                                               notes=f"{groups} system prompts of 512 tokens, 2 questions of 64 "
                                                     f"each, 32 out, {CONCURRENCY} in flight"),
    }


class Session:
    """One cluster's worth of runs, each recorded with the CPU the rest of the machine used meanwhile."""

    def __init__(self, name: str, model: clusters.BenchModel, out: Path, log: Callable[[str], None]):
        self.name, self.model, self.out, self.log, self.runs = name, model, out, log, []
        self.pids: dict[str, int] = {}

    def warm_up(self, target: str, base_url: str) -> None:
        """Unrecorded: a first load on a target is slower (lazy initialisation in SGLang and torch)."""
        serving.run(WARM_UP, base_url, self.out, f"{self.name}-{target}-warm-up", seed=0, slo=self.model.slo_ms,
                    model=self.model.path)

    def measure(self, workload: serving.Workload, target: str, base_url: str, flush: list[str], repeat: int) -> None:
        clusters.flush_caches(flush)
        probe = cpu.probe_ms()
        window = cpu.Window(self.pids)
        tag = f"{self.name}-{target}-{workload.name}-{repeat}"
        row = serving.run(workload, base_url, self.out, tag, seed=repeat + 1, slo=self.model.slo_ms,
                          model=self.model.path)
        cores = window.cores()
        self.runs.append({"session": self.name, "target": target, "workload": workload.name, "repeat": repeat,
                          **row, "cores_used_by_others": cores["others"], "machine_probe_ms": probe,
                          "cpu_cores": cores["per_tree"]})
        self.log(f"{tag}: {row['request_throughput']:.2f} req/s, {row['output_throughput']:.0f} tok/s, TTFT p50 "
                 f"{row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms, errors {row['errors']}, "
                 f"others {cores['others']:.2f} cores, probe {probe:.0f} ms")

    def idle(self, seconds: float) -> dict:
        """The cluster as `make up` runs it, idle: only its own router and the workers' launchers probe the workers
        (measured before the benchmark's routers start: each of them probes the workers' /health too)."""
        time.sleep(5)  # let start-up work (first probes, registrations, logs) settle
        cores = cpu.measure_idle(self.pids, seconds)
        cores["local_yaml_shape"] = LOCAL_SHAPE
        cores["local_yaml_shape_total"] = round(sum(cores["per_tree"][n] for n in LOCAL_SHAPE), 4)
        if "planner" in cores["per_tree"]:  # `make up PLANNER=1`
            cores["with_planner_total"] = round(cores["local_yaml_shape_total"] + cores["per_tree"]["planner"], 4)
        self.log(f"{self.name}: idle for {seconds:.0f} s: {cores['local_yaml_shape_total']:.3f} cores "
                 f"({', '.join(f'{k} {v:.3f}' for k, v in cores['per_tree'].items())})")
        return cores


def cluster_pids(cluster) -> dict[str, int]:
    return {name: p.popen.pid for name, p in cluster.processes.items()}


def run_busy_poll(args, load: dict, log_dir: Path, log) -> tuple[list, dict]:
    """sleep-on-idle off: a 1P+1D cluster (configs/local.yaml's shape), its idle CPU, and the `ours` loads."""
    session = Session("busy-poll", args.bench_model, log_dir, log)
    cluster = clusters.start_cluster(args.bench_model, 1, sleep_on_idle=False, log_dir=log_dir / "busy-poll")
    started = []
    try:
        cluster.wait_ready()
        session.pids = cluster_pids(cluster)
        idle_cpu = session.idle(args.idle_seconds)
        ours = procs.start_ours("router-ours", log_dir, clusters.workers(cluster, "prefill"),
                                clusters.workers(cluster, "decode"), "round_robin")
        started.append(ours)
        clusters.wait_generates(ours, 120)
        session.pids["router-ours"] = ours.popen.pid
        flush = [w.url for w in clusters.workers(cluster, "prefill") + clusters.workers(cluster, "decode")]
        session.warm_up("ours", ours.url)
        for repeat in range(args.repeats):
            for name in BUSY_POLL_LOADS:
                session.measure(load[name], "ours", ours.url, flush, repeat)
    finally:
        for proc in started:
            proc.stop()
        cluster.stop()
    return session.runs, idle_cpu


def run_main(args, load: dict, log_dir: Path, log) -> tuple[list, dict, dict]:
    """sleep-on-idle on: 2 prefills + 1 decode, the colocated server, and one router per target."""
    session = Session("main", args.bench_model, log_dir, log)
    cluster, started = clusters.start_cluster(args.bench_model, 2, sleep_on_idle=True, log_dir=log_dir / "main"), []
    try:
        colocated = clusters.start_colocated(args.bench_model, log_dir, sleep_on_idle=True)
        started.append(colocated)
        began = time.monotonic()
        cluster.wait_ready()
        clusters.wait_generates(colocated)
        startup = round(time.monotonic() - began, 1)
        session.pids = {**cluster_pids(cluster), "colocated": colocated.popen.pid}
        idle_cpu = session.idle(args.idle_seconds)
        prefills, decodes = clusters.workers(cluster, "prefill"), clusters.workers(cluster, "decode")
        routers = {"ours": procs.start_ours("router-ours", log_dir, prefills[:1], decodes, "round_robin"),
                   # A second, identical copy of ours (an A/A control): how far two equal routers on the same
                   # workers drift apart is the noise any router difference must exceed.
                   "ours-twin": procs.start_ours("router-ours-twin", log_dir, prefills[:1], decodes, "round_robin"),
                   "sglang": procs.start_sglang(log_dir, prefills[0], decodes[0]),
                   "prefix": procs.start_ours("router-prefix", log_dir, prefills, decodes, "prefix"),
                   "round_robin": procs.start_ours("router-round-robin", log_dir, prefills, decodes, "round_robin")}
        started += routers.values()
        for proc in routers.values():
            clusters.wait_generates(proc, 120)
        session.pids.update({f"router-{k}": p.popen.pid for k, p in routers.items()})
        urls = {"colocated": colocated.url, **{k: p.url for k, p in routers.items()}}
        for target, url in urls.items():
            session.warm_up(target, url)
        log(f"main: serving {startup} s after the start; warmed up")
        pd_workers = [prefills[0].url, decodes[0].url]
        all_workers = [w.url for w in prefills + decodes]
        for repeat in range(args.repeats):
            turn = repeat % 4  # each target takes a different place in turn
            for target in (["ours", "sglang", "ours-twin", "colocated"] * 2)[turn:turn + 4]:
                session.measure(load["random"], target, urls[target],
                                [colocated.url] if target == "colocated" else pd_workers, repeat)
            for target in (["ours", "colocated"] if repeat % 2 == 0 else ["colocated", "ours"]):
                session.measure(load["serial"], target, urls[target],
                                [colocated.url] if target == "colocated" else pd_workers, repeat)
            for policy in (["prefix", "round_robin"] if repeat % 2 == 0 else ["round_robin", "prefix"]):
                session.measure(load["shared-prefix"], policy, urls[policy], all_workers, repeat)
    finally:
        for proc in reversed(started):
            proc.stop()
        cluster.stop()
    return session.runs, idle_cpu, {"seconds_to_serving": startup}


def run_idle(args, log_dir: Path, log) -> dict:
    """Only the idle CPU of the `make up` shape (1 prefill, 1 decode, sleep-on-idle on) and of its planner (`make up
    PLANNER=1`, its own row), measured for longer than a full run does: the probes now come every
    idle_health_interval (15 s) and the planner decides every 60 s, so a window must hold several."""
    session = Session("idle", args.bench_model, log_dir, log)
    cluster = clusters.start_cluster(args.bench_model, 1, sleep_on_idle=True, log_dir=log_dir / "idle", planner=True)
    try:
        cluster.wait_ready()
        session.pids = cluster_pids(cluster)
        time.sleep(30)  # the router's admission canaries and first probes are start-up work, not idling
        return session.idle(args.idle_seconds)
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few prompts, 2 repeats: a check of the harness")
    parser.add_argument("--model", choices=sorted(clusters.MODELS), default="tiny-llama",
                        help="the model every worker serves (default: the demo model)")
    parser.add_argument("--repeats", type=int, help="runs of each target and load (default 3, --quick 2)")
    parser.add_argument("--idle-seconds", type=float, help="idle CPU window (default 20 s, --quick 8 s)")
    parser.add_argument("--no-busy-poll", action="store_true", help="skip the sleep-on-idle off session (skipped for "
                        "models whose BenchModel says so: clusters.BenchModel.busy_poll_session)")
    parser.add_argument("--idle-only", action="store_true",
                        help="only the idle CPU of the make up shape (bench/results/idle.json, default 120 s)")
    parser.add_argument("--decode-only", action="store_true",
                        help="decode on fake KV instead (bench.cluster.decode_only)")
    parser.add_argument("--out", type=Path, help="result path without extension (default bench/results/cluster)")
    args, rest = parser.parse_known_args(argv)
    if args.decode_only:
        from bench.cluster import decode_only

        return decode_only.main(rest + (["--quick"] if args.quick else []))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.idle_seconds = args.idle_seconds or (120.0 if args.idle_only else 8.0 if args.quick else 20.0)
    args.bench_model = model = clusters.MODELS[args.model]
    suffix = "" if args.model == "tiny-llama" else f"-{args.model}"
    out = args.out or RESULTS / (f"cluster-quick{suffix}" if args.quick else f"cluster{suffix}")
    began, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.monotonic()

    def log(line: str) -> None:
        print(f"[cluster {time.monotonic() - t0:5.0f}s] {line}", flush=True)

    if args.model == "tiny-llama":
        subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(REPO / model.path)], cwd=REPO,
                       check=True)
    elif not (REPO / model.path / "model.safetensors").is_file():
        parser.error(f"{model.path} is missing: `make setup` builds it")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    log(f"process logs and bench_serving outputs in {log_dir}")
    measured_on = {**machine.machine(), "cores_busy_before_start": round(cpu.busy_cores(2.0), 3)}
    if args.idle_only:
        result = {"benchmark": f"idle CPU of the make up shape on {model.path} (sleep-on-idle on)",
                  "settings": {"idle_seconds": args.idle_seconds, "model": model.path}, "machine": measured_on,
                  "started_utc": began, "idle_cpu_cores": run_idle(args, log_dir, log)}
        path = args.out or RESULTS / "idle"
        Path(f"{path}.json").write_text(json.dumps(result, indent=1) + "\n")
        plot.draw_idle(result, Path(f"{path}.png"))
        log(f"wrote {path}.json and {path}.png")
        return 0
    load = loads(args.quick, full=model.prompts)
    runs, idle_cpu = [], {}
    if args.no_busy_poll or not model.busy_poll_session:
        log("sleep-on-idle off session skipped" + ("" if args.no_busy_poll else f" for {args.model} (see "
                                                   "clusters.BenchModel.busy_poll_session)"))
    else:
        busy_runs, idle_cpu["sleep_on_idle_off"] = run_busy_poll(args, loads(args.quick, busy_poll=True),
                                                                 log_dir, log)
        runs += busy_runs
    main_runs, idle_cpu["sleep_on_idle_on"], startup = run_main(args, load, log_dir, log)
    runs += main_runs
    result = {
        "benchmark": f"pdcluster on real SGLang (CPU, {model.path}): our router vs SGLang's router vs colocated, "
                     "prefix vs round_robin, sleep-on-idle on vs off",
        "settings": {"quick": args.quick, "repeats": args.repeats, "slo_ms": model.slo_ms, "model": model.path,
                     "worker_args": model.worker_args,
                     "loads": {k: {"argv": w.argv(0), "notes": w.notes} for k, w in load.items()},
                     "busy_poll_prompts": {k: w.prompts for k, w in loads(args.quick, busy_poll=True).items()
                                           if k in BUSY_POLL_LOADS},
                     "idle_seconds": args.idle_seconds},
        "machine": measured_on, "started_utc": began, "wall_seconds": round(time.monotonic() - t0), "startup": startup,
        "idle_cpu_cores": idle_cpu, "runs": runs, "summary": report.summarize(runs),
    }
    result["derived"] = report.derive(result["summary"], idle_cpu, runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot.draw(result, Path(f"{out}.png"))
    for line in report.lines(result["derived"]):
        log(line)
    log(f"wrote {out}.json and {out}.png in {result['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
