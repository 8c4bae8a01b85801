"""The real clusters on SGLang the benchmarks measure (bench.cluster, bench.pd, bench.routing, bench.openai.n_choices),
and the serving targets over them, started and stopped by their own PIDs.

Workers come from pdcluster.local (the launcher behind `make up` and the end-to-end tests) on ports of their own;
each router under test is a separate process over a static list of those workers, so that two routers (ours and
SGLang's) or two policies see exactly the same SGLang processes. The colocated baseline is one plain SGLang server
(no PD) with the same CPU profile as a pdcluster worker.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.harness import procs
from bench.harness.paths import REPO
from pdcluster.local import models
from pdcluster.local.cluster import LocalCluster
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from pdcluster.worker import environment, plan
from pdcluster.worker.registrar import forward_tokens


@dataclass(frozen=True)
class BenchModel:
    """A model the benchmark serves: where it is, the worker options over configs/prefill.yaml and decode.yaml that
    serve it, and the SLO behind goodput (about 4x its unloaded TTFT and TPOT on this machine, so that a request
    fails it by queueing behind others, not by the machine's usual noise)."""
    path: str
    served: str
    max_total_tokens: int  # the PD workers' KV pool, which the colocated server gets too
    slo_ms: dict[str, float]
    worker_args: list[str] = field(default_factory=list)
    # Whether the sleep-on-idle off session runs by default. Not for a model whose forwards take seconds: there two
    # busy-polling schedulers and their torch threads oversubscribe the 2 cores, so that every OpenMP barrier
    # waits for a descheduled thread. Measured on SmolLM2 (2026-11-25): the prefill at 14 ms a prompt token (5 on
    # a quiet machine), the decode's snapshot still for > 30 s over one running request, the router ejecting the
    # prefill as hung 5 times in 10 minutes, and 40 requests not done after 12 minutes.
    busy_poll_session: bool = True
    # A full run's random prompts, serial prompts and shared-prefix groups (bench.cluster.loads). Each run must last
    # long enough for its ramp-up and tail not to decide its rate, and a whole run of 3 repeats should fit in ~1 h.
    prompts: tuple[int, int, int] = (120, 36, 40)


MODELS = {
    # The demo model (2 layers): the cluster's own costs dominate. Unloaded PD: TTFT ~155 ms, TPOT ~25 ms.
    "tiny-llama": BenchModel(models.DEMO, "tiny-llama", 65536, {"ttft": 1000.0, "tpot": 100.0}, models.DEMO_ARGS),
    # SmolLM2-135M-Instruct (30 layers), what make up serves: configs/prefill.yaml and decode.yaml as they are.
    # Unloaded PD (--quick, 2 cores): TTFT ~600 ms, TPOT ~60 ms.
    "smollm2": BenchModel(models.SMOLLM2, "smollm2-135m-instruct", plan.CPU_FLAGS["max-total-tokens"],
                          {"ttft": 2500.0, "tpot": 250.0}, busy_poll_session=False,
                          # At ~0.16 requests/s through PD (2026-11-25), the demo model's counts made one repeat 67
                          # minutes; these keep each PD run over 3 minutes and the whole run ~1 h.
                          prompts=(30, 10, 16)),
}
# 13xxx: out of the range where SGLang picks ports at random (22000-29999) and of the ephemeral one, away from the
# tests' (12xxx, 18xxx-21xxx, 31xxx), bench/persistence's (14xxx) and tests/chaos'.
PORTS = {"router": 13000, "bootstrap": 13998, "prefill": 13100, "kv_bootstrap": 13300, "decode": 13200,
         "colocated": 13500, "kv_events": 13400, "planner": 13900}


def worker_config(role: str, sleep_on_idle: bool, out_dir: Path) -> str:
    """configs/<role>.yaml, or a copy with sleep-on-idle switched off (the only difference)."""
    source = f"configs/{role}.yaml"
    if sleep_on_idle:
        return source
    data = yaml.safe_load((REPO / source).read_text())
    data["sleep-on-idle"] = False
    path = out_dir / f"{role}-busy-poll.yaml"
    path.write_text(f"# {source} with sleep-on-idle off, written by bench.cluster\n" + yaml.safe_dump(data))
    return str(path)


def start_cluster(model: BenchModel, prefills: int, sleep_on_idle: bool, log_dir: Path,
                  extra_args: dict[str, list[str]] | None = None, planner: bool | str = False,
                  decodes: int = 1) -> LocalCluster:
    """`extra_args`: worker options per role over the model's (e.g. bench.pd: {"prefill": ["--cluster", "cpus=0"]});
    `planner`: with the SLO planner of `make up PLANNER=1` (True: configs/planner.yaml, or that config file)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = extra_args or {}
    spec = LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=PORTS["bootstrap"]),
        router=ComponentSpec(config="configs/router.yaml", port=PORTS["router"]),
        prefill=WorkerGroupSpec(config=worker_config("prefill", sleep_on_idle, log_dir),
                                args=[*model.worker_args, *extra.get("prefill", [])],
                                count=prefills, first_port=PORTS["prefill"],
                                first_kv_bootstrap_port=PORTS["kv_bootstrap"], first_kv_events_port=PORTS["kv_events"]),
        decode=WorkerGroupSpec(config=worker_config("decode", sleep_on_idle, log_dir),
                               args=[*model.worker_args, *extra.get("decode", [])],
                               count=decodes, first_port=PORTS["decode"]),
        planner=ComponentSpec(config="configs/planner.yaml" if planner is True else str(planner), port=PORTS["planner"])
        if planner else None,
        ready_timeout=900,
    )
    cluster = LocalCluster(spec, log_dir, report=lambda line: print(f"cluster: {line}", flush=True))
    cluster.start()
    return cluster


def workers(cluster: LocalCluster, role: str) -> list[procs.Worker]:
    """The cluster's workers of `role`, as the routers under test are given them (a static list): a prefill with its
    largest forward pass from its /server_info, as discovered workers register it (routers share these workers)."""
    group = cluster.spec.prefill if role == "prefill" else cluster.spec.decode
    listed = []
    for i in range(group.count):
        url = f"http://127.0.0.1:{group.first_port + i}"
        if role == "prefill":
            info = httpx.get(f"{url}/server_info", timeout=60).json()
            listed.append(procs.Worker(f"{role}-{i}", url, group.first_kv_bootstrap_port + i,
                                       forward_tokens(info, None)))
        else:
            listed.append(procs.Worker(f"{role}-{i}", url))
    return listed


def colocated_command(model: BenchModel, port: int, sleep_on_idle: bool) -> tuple[list[str], dict[str, str]]:
    """One SGLang server doing prefill and decode, with the pdcluster CPU profile minus the PD options, and the PD
    workers' KV pool."""
    flags = {k: v for k, v in plan.CPU_FLAGS.items() if not k.startswith("disaggregation")}
    flags["max-total-tokens"] = model.max_total_tokens
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model.path,
            "--served-model-name", model.served, "--host", procs.HOST, "--port", str(port), "--dtype", "float32",
            "--log-level", "warning"]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    # The prefill's CPU workaround (a prefix-cache hit with the overlap scheduler fails on CPU) applies here too.
    argv += ["--disable-overlap-schedule"] + (["--sleep-on-idle"] if sleep_on_idle else [])
    shim = str(environment.CPU_SHIM_DIR)
    shim += os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
    return argv, {**environment.COMMON_ENV, **environment.CPU_ENV, "PYTHONPATH": shim}


def start_colocated(model: BenchModel, log_dir: Path, sleep_on_idle: bool, extra_args: list[str] = ()) -> procs.Proc:
    argv, env = colocated_command(model, PORTS["colocated"], sleep_on_idle)
    argv += list(extra_args)
    return procs.start("colocated", argv, log_dir, PORTS["colocated"], env=env)


def wait_generates(proc: procs.Proc, timeout: float = 600) -> float:
    return procs.wait_ready(proc, lambda: procs.generate_ok(proc.port), timeout)


def flush_caches(urls: list[str], within: float = 120.0) -> None:
    """Empty every worker's radix cache, so no run profits from the prompts of the one before. SGLang refuses (400,
    "Cache not flushed because there are pending requests") while anything is queued, a probe or the last request's
    hand-off included: once that went unnoticed and a run got the previous run's prompts as cache hits (3x the
    requests/s of its repeats), so a refusal is retried, and a worker that never flushes stops the benchmark."""
    for url in urls:
        deadline = time.monotonic() + within
        while True:
            response = httpx.post(f"{url}/flush_cache", timeout=30)
            if response.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not flush its cache within {within:.0f} s: {response.status_code} "
                                   f"{response.text[:200]!r}")
            time.sleep(1.0)
