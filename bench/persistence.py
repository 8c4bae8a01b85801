"""`python -m bench.persistence`: what the KV store on disk saves. Time to first token (TTFT) of a long prompt through
the router of a real local cluster, at several prompt lengths:

  cold     the first time: the prefill computes the whole prompt;
  storage  the same prompt after the prefill was restarted (SIGTERM, start): its pages read from the KV directory,
           which the page cache still holds (a restart, not a reboot);
  disk     the same, with the namespace's files first dropped from the page cache (posix_fadvise DONTNEED on those
           files only) and the prefill's memory tiers emptied (/flush_cache): every byte read from the device;
  memory   the same prompt again on the running prefill: its device KV cache, the best any cache can do.

The floor of a storage hit is the prompt's KV bytes over the read bandwidth of the namespace's files (a timed read of
all of them, from the device and from the page cache). Target: storage <= 0.2 x cold at the longest prompt.

The model is built with scripts/build_demo_model.py (the demo model's tokenizer, random weights) in one of SHAPES,
once, into models/persistence-bench-<shape>; or, with `--shape smollm2`, it is SmolLM2-135M-Instruct as `make setup`
built it (a real model, what `make up` serves; 30 layers, 45 KiB of KV per token; its context holds 8192 tokens, so
its longest prompt is 8000). The cluster is pdcluster.local with configs/prefill-persistent.yaml and
configs/decode-persistent.yaml, on ports 29xxx, its KV in /tmp/pdcluster-bench-persistence/kv (emptied first).
Writes bench/results/persistence.json and .png (default shape), or persistence-<shape>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml

from bench import idle
from bench.plot import pyplot, save
from bench.report import git
from pdcluster.local import ComponentSpec, LocalCluster, LocalSpec, WorkerGroupSpec
from pdcluster.models import SMOLLM2

REPO = Path(__file__).resolve().parent.parent  # `python -m bench.persistence` runs from the checkout's root

RESULTS = Path(__file__).resolve().parent / "results"
WORK = Path("/tmp/pdcluster-bench-persistence")
SERVED = "persistence-bench"
MAX_POSITIONS = 8704
# SGLang's CPU attention (torch_native) computes, for a prompt whose first tokens are cached, the attention of the whole
# prompt again (a full-length query, torch_native_backend._run_sdpa_forward_extend): a hit skips the cached tokens'
# MLP and projections, not their attention. So what a hit can save depends on the share of attention in the prefill.
SHAPES = {
    # The default: at 8k tokens, attention is ~15% of the prefill's multiply-adds, as in Llama-3-8B (hidden 4096, MLP
    # 14336, 32 heads); a small model in Llama's own proportions is mostly attention at 8k, which no model of that
    # size serves. 4 layers, hidden 512, 8 query heads sharing 2 KV heads, MLP 16384: 103M parameters, 4 KiB of KV
    # per token in float32.
    "8b-balance": {"layers": 4, "hidden": 512, "intermediate": 16384, "heads": 8, "kv_heads": 2},
    # Llama's proportions at a size a CPU runs (hidden 768, MLP 2048): ~50% attention at 8k tokens. 39M parameters,
    # 12 KiB of KV per token.
    "llama-small": {"layers": 6, "hidden": 768, "intermediate": 2048, "heads": 12, "kv_heads": 4},
}
DEFAULT_SHAPE = "8b-balance"
REAL = "smollm2"  # --shape smollm2: the real model make setup built, not one of SHAPES
INITIALIZER_RANGE = 0.02
LENGTHS = (1024, 2048, 4096, 8192)
REAL_LENGTHS = (1024, 2048, 4096, 8000)  # SmolLM2's context is 8192 tokens: the prompt and its one new token fit
# 29xxx: below the ephemeral range (32768+), where a port can be taken by any outgoing connection; not the tests'.
PORTS = {"bootstrap": 29998, "router": 29000, "prefill": 29300, "kv_bootstrap": 29301, "decode": 29400}
PAGE = 64
TARGET_RATIO = 0.2
SERIES = ("cold", "storage", "disk", "memory")


def build_model(shape: str) -> tuple[Path, dict]:
    if shape == REAL:
        out = REPO / SMOLLM2
        if not (out / "build-info.json").is_file():
            raise SystemExit(f"{out} is missing: `make setup` builds it")
        dims = {"model": "SmolLM2-135M-Instruct (scripts/fetch_smollm2.py)"}
    else:
        out = REPO / "models" / f"persistence-bench-{shape}"
        dims = {**SHAPES[shape], "max_positions": MAX_POSITIONS}
        options = [f"--{k.replace('_', '-')}={v}" for k, v in dims.items()]
        subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(out), *options,
                        f"--initializer-range={INITIALIZER_RANGE}"], cwd=REPO, check=True)
    config = json.loads((out / "config.json").read_text())
    info = json.loads((out / "build-info.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, hidden, inter = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    kv_dim = config["num_key_value_heads"] * head_dim
    n = LENGTHS[-1]
    dense = n * layers * (2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter)  # projections + MLP
    attention = layers * 2 * (n * n // 2) * hidden  # QK^T and PV over the causal half, every query head
    return out, {"path": str(out.relative_to(REPO)), "shape": shape, "dims": dims,
                 "initializer_range": None if shape == REAL else INITIALIZER_RANGE,
                 "parameters": info["num_parameters"], "dtype": "float32",
                 "kv_bytes_per_token": layers * 2 * kv_dim * 4,
                 f"attention_share_of_prefill_at_{n}": round(attention / (attention + dense), 3)}


def write_configs(model: Path) -> LocalSpec:
    if WORK.exists():
        shutil.rmtree(WORK)
    (WORK / "kv").mkdir(parents=True)
    for role in ("prefill", "decode"):
        raw = yaml.safe_load((REPO / "configs" / f"{role}-persistent.yaml").read_text())
        # A KV pool of 16k tokens holds the longest prompt (the CPU profile's 64k would make SGLang's HiCache ask for
        # a host pool twice that size, on top of its 10 GiB reserve).
        raw.update({"model-path": str(model), "served-model-name": SERVED, "log-level": "warning",
                    "max-total-tokens": 16384})
        raw["cluster"]["bootstrap_url"] = f"http://127.0.0.1:{PORTS['bootstrap']}"
        raw["cluster"]["kv_store"]["dir"] = str(WORK / "kv")
        if role == "decode":
            raw["cluster"]["kv_store"]["decode_offload"] = False  # it generates 1 token: nothing to write
        (WORK / f"{role}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    router = {"host": "127.0.0.1", "port": PORTS["router"], "bootstrap_url": f"http://127.0.0.1:{PORTS['bootstrap']}",
              "read_timeout": 1800, "first_byte_timeout": 1800, "log_level": "warning"}
    from router.config import RouterConfig

    if "stall_timeout" in RouterConfig.model_fields:
        # A prefill computing one 4096-token chunk of an 8k prompt on a CPU reports no progress for many seconds:
        # that is not a hung worker.
        router["stall_timeout"] = 600
    (WORK / "router.yaml").write_text(yaml.safe_dump(router))
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=PORTS["bootstrap"]),
        router=ComponentSpec(config=str(WORK / "router.yaml"), port=PORTS["router"]),
        prefill=WorkerGroupSpec(config=str(WORK / "prefill.yaml"), count=1, first_port=PORTS["prefill"],
                                first_kv_bootstrap_port=PORTS["kv_bootstrap"]),
        decode=WorkerGroupSpec(config=str(WORK / "decode.yaml"), count=1, first_port=PORTS["decode"]),
        log_dir=str(WORK / "logs"), ready_timeout=900)


def prompt(tag: str, length: int, vocab: int) -> list[int]:
    rng = random.Random(tag)  # another tag, another first page: nothing of it is stored yet
    return [0] + [rng.randrange(4, vocab) for _ in range(length - 1)]


def ttft(client: httpx.Client, ids: list[int]) -> dict:
    """One request with max_new_tokens=1, not streamed: its latency is the time to the first token as the client sees
    it through the router (prefill, KV transfer to the decode, the decode's answer)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    started = time.perf_counter()
    response = client.post("/generate", json=body)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    meta = response.json()["meta_info"]
    tiers = meta.get("cached_tokens_details") or {}
    return {"seconds": round(seconds, 4), "cached_tokens": meta.get("cached_tokens", 0),
            "storage": int(tiers.get("storage") or 0), "device": int(tiers.get("device") or 0)}


def namespace_files() -> list[Path]:
    return sorted((WORK / "kv").glob("*/*.bin"))


def settle(quiet: float = 2.0, timeout: float = 120) -> None:
    """Wait until the prefill's background writer has put every page on disk."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = sorted(p.name for p in (WORK / "kv").glob("*/*") if p.name.endswith((".bin", ".tmp")))
        if names != last or any(n.endswith(".tmp") for n in names):
            last, since = names, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.2)


def drop_from_page_cache(files: list[Path]) -> None:
    """Only these files: flushed, then their pages dropped (the rest of the machine's page cache is left alone)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bandwidth(files: list[Path]) -> dict:
    """Bytes per second reading every file of the namespace, from the device (page cache dropped first) and from the
    page cache (read again at once)."""
    total = sum(p.stat().st_size for p in files)
    result = {"bytes": total, "files": len(files)}
    for name in ("device", "page_cache"):
        if name == "device":
            drop_from_page_cache(files)
        started = time.perf_counter()
        for path in files:
            with open(path, "rb", buffering=0) as handle:
                while handle.read(1 << 20):
                    pass
        result[f"{name}_bytes_per_s"] = round(total / (time.perf_counter() - started))
    return result


class Bench:
    def __init__(self, spec: LocalSpec):
        self.cluster = LocalCluster(spec, Path(spec.log_dir))
        self.client = httpx.Client(base_url=spec.router_url, timeout=1800)
        self.prefill_url = f"http://127.0.0.1:{PORTS['prefill']}"
        self.prefill_id = f"prefill-127.0.0.1-{PORTS['prefill']}"

    def start(self) -> None:
        self.cluster.start()
        self.cluster.wait_ready()

    def stop(self) -> None:
        self.client.close()
        self.cluster.stop(timeout=60)

    def restart_prefill(self) -> float:
        """SIGTERM, wait for it to go, start it again, wait for the router to take it back; seconds it took."""
        process = self.cluster.processes["prefill-0"]
        started = time.monotonic()
        process.signal(signal.SIGTERM)
        process.popen.wait(timeout=120)
        while self._healthy().get(self.prefill_id):
            time.sleep(0.2)
        process.start()
        while not self._healthy().get(self.prefill_id):
            if not process.running:
                raise RuntimeError(f"prefill exited ({process.popen.returncode}):\n{process.tail(30)}")
            time.sleep(0.5)
        return round(time.monotonic() - started, 1)

    def _healthy(self) -> dict:
        try:
            return {w["worker_id"]: w["healthy"] for w in self.client.get("/ready").json()["workers"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}

    def flush_memory_tiers(self) -> None:
        httpx.post(f"{self.prefill_url}/flush_cache", params={"timeout": 60}, timeout=120).raise_for_status()

    def measure(self, series: str, ids: list[int]) -> dict:
        sample = {**ttft(self.client, ids), "busy_cores_before": round(idle.busy_cores(1.0), 2)}
        print(f"bench: {len(ids):5d} tokens {series:7s} {sample}", flush=True)
        return sample


def run(shape: str, lengths: tuple[int, ...], repeats: int) -> dict:
    path, model = build_model(shape)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    bench = Bench(write_configs(path))
    print(f"bench: starting the cluster (logs in {WORK / 'logs'}) ...", flush=True)
    samples: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in lengths} for s in SERIES}
    restarts = []
    try:
        bench.start()
        ttft(bench.client, prompt("warm-up", 256, vocab))  # first-request costs (allocators, lazy imports)
        for rep in range(repeats):
            prompts = {n: prompt(f"rep{rep}-len{n}", n, vocab) for n in lengths}
            for n in lengths:
                samples["cold"][n].append(bench.measure("cold", prompts[n]))
            settle()
            restarts.append(bench.restart_prefill())
            ttft(bench.client, prompt(f"warm-up-{rep}", 256, vocab))  # the restarted prefill's first-request costs
            for n in lengths:
                samples["storage"][n].append(bench.measure("storage", prompts[n]))
            for n in lengths:
                samples["memory"][n].append(bench.measure("memory", prompts[n]))
            for n in lengths:
                bench.flush_memory_tiers()
                drop_from_page_cache(namespace_files())
                samples["disk"][n].append(bench.measure("disk", prompts[n]))
        bandwidth = read_bandwidth(namespace_files())
        page_bytes = statistics.median(p.stat().st_size for p in namespace_files())
    finally:
        bench.stop()
        shutil.rmtree(WORK / "kv", ignore_errors=True)  # hundreds of MB of pages; the logs stay
    return report(model, lengths, repeats, samples, restarts, bandwidth, page_bytes)


def report(model: dict, lengths, repeats: int, samples: dict, restarts: list, bandwidth: dict,
           page_bytes: float) -> dict:
    rows = []
    for n in lengths:
        stored = (n - 1) // PAGE * PAGE  # whole pages, and the last token is always computed (it makes the logits)
        kv_bytes = stored // PAGE * page_bytes
        row = {"prompt_tokens": n, "stored_tokens": stored, "kv_bytes": int(kv_bytes),
               "floor_device_s": round(kv_bytes / bandwidth["device_bytes_per_s"], 4),
               "floor_page_cache_s": round(kv_bytes / bandwidth["page_cache_bytes_per_s"], 4)}
        for series in SERIES:
            row[f"{series}_ttft_s"] = round(statistics.median(r["seconds"] for r in samples[series][n]), 4)
        for series in SERIES[1:]:
            row[f"{series}_over_cold"] = round(row[f"{series}_ttft_s"] / row["cold_ttft_s"], 4)
        # What reading from disk adds to a hit: the storage TTFT less the same hit from memory.
        row["storage_minus_memory_s"] = round(row["storage_ttft_s"] - row["memory_ttft_s"], 4)
        row["runs"] = {series: samples[series][n] for series in SERIES}
        rows.append(row)
    longest = rows[-1]
    every_page_hit = all(r["storage"] >= longest["stored_tokens"] for s in ("storage", "disk")
                         for r in longest["runs"][s])
    return {
        "benchmark": "TTFT of a long prompt: cold, from the KV store on disk after a prefill restart, from memory",
        "settings": {"lengths": list(lengths), "repeats": repeats, "page_size": PAGE, "max_new_tokens": 1,
                     "statistic": "median over repeats", "path": "client -> router -> prefill + decode (PD, CPU)",
                     "configs": ["configs/prefill-persistent.yaml", "configs/decode-persistent.yaml"],
                     "overrides": {"max-total-tokens": 16384, "decode kv_store.decode_offload": False},
                     "kv_dir": str(WORK / "kv")},
        "model": model,
        "machine": machine(),
        "prefill_restart_seconds": restarts,
        "read_bandwidth": bandwidth,
        "page_bytes": page_bytes,
        "results": rows,
        "target": {
            "rule": f"storage TTFT <= {TARGET_RATIO} x cold TTFT at {longest['prompt_tokens']} tokens",
            "storage_over_cold": longest["storage_over_cold"],
            "met": longest["storage_over_cold"] <= TARGET_RATIO,
            "disk_over_cold": longest["disk_over_cold"],
            "met_from_the_device_too": longest["disk_over_cold"] <= TARGET_RATIO,
            "memory_over_cold": longest["memory_over_cold"],
            "every_stored_page_hit": every_page_hit,
        },
    }


def machine() -> dict:
    import sglang
    import torch

    return {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git("rev-parse", "HEAD"),
            "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "sglang": sglang.__version__,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def draw(result: dict, path: Path) -> None:
    rows = result["results"]
    lengths = [r["prompt_tokens"] for r in rows]
    fig, ax = pyplot().subplots(figsize=(8, 5))
    styles = {"cold": ("#d62728", "cold (computed)"), "storage": ("#1f77b4", "from disk after a restart (page cache)"),
              "disk": ("#17becf", "from disk, page cache dropped"), "memory": ("#2ca02c", "from memory (device)")}
    for series, (color, label) in styles.items():
        ax.plot(lengths, [r[f"{series}_ttft_s"] for r in rows], "o-", color=color, label=label)
    ax.plot(lengths, [r["floor_device_s"] for r in rows], "--", color="#7f7f7f", label="floor: KV bytes / device read")
    ax.plot(lengths, [TARGET_RATIO * r["cold_ttft_s"] for r in rows], ":", color="#d62728",
            label=f"target: {TARGET_RATIO} x cold")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    m = result["model"]
    ax.set_title(f"KV store on disk, TTFT through the router on 2 CPU cores: {m['shape']} "
                 f"({m['parameters'] / 1e6:.0f}M params, {m['kv_bytes_per_token'] // 1024} KiB KV/token)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.persistence", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted([*SHAPES, REAL]), default=DEFAULT_SHAPE,
                        help=f"a random-weight model of that shape, or {REAL}: the real model make setup built")
    parser.add_argument("--lengths", help="prompt lengths in tokens (default "
                                          f"{','.join(map(str, LENGTHS))}; {REAL}: {','.join(map(str, REAL_LENGTHS))})")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="default: bench/results/persistence.json, or persistence-<shape>.json")
    args = parser.parse_args(argv)
    default = REAL_LENGTHS if args.shape == REAL else LENGTHS
    lengths = tuple(sorted(int(n) for n in args.lengths.split(","))) if args.lengths else default
    context = 8192 if args.shape == REAL else MAX_POSITIONS
    if lengths[-1] + 1 > context:
        parser.error(f"the longest prompt must leave room for one token within {context}")
    name = "persistence" if args.shape == DEFAULT_SHAPE else f"persistence-{args.shape}"
    out = Path(args.out) if args.out else RESULTS / f"{name}.json"
    result = run(args.shape, lengths, args.repeats)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    draw(result, out.with_suffix(".png"))
    for row in result["results"]:
        print(f"{row['prompt_tokens']:6d} tokens: cold {row['cold_ttft_s']:.3f}s  storage {row['storage_ttft_s']:.3f}s"
              f"  disk {row['disk_ttft_s']:.3f}s  memory {row['memory_ttft_s']:.3f}s"
              f"  floor {row['floor_device_s']:.3f}s")
    target = result["target"]
    print(f"target ({target['rule']}): {'met' if target['met'] else 'NOT met'} ({target['storage_over_cold']:.3f}; "
          f"a hit from memory: {target['memory_over_cold']:.3f}); wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
