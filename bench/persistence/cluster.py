"""bench.persistence's model and clusters: the benchmark model, and two local clusters side by side, the same but for
pdcluster's CPU attention (cluster.cpu_attention on in one, off in the other), each with its own KV directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from bench.harness import cpu
from bench.harness.paths import REPO
from pdcluster.local.cluster import LocalCluster
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec

WORK = Path("/tmp/pdcluster-bench-persistence")
SERVED = "persistence-bench"
MAX_POSITIONS = 8704
SHAPES = {
    # At 8k tokens, attention is ~15% of the prefill's multiply-adds, as in Llama-3-8B (hidden 4096, MLP 14336, 32
    # heads); a small model in Llama's own proportions is mostly attention at 8k, which no model of that size serves.
    # 4 layers, hidden 512, 8 query heads sharing 2 KV heads, MLP 16384: 103M parameters, 4 KiB of KV per token.
    "8b-balance": {"layers": 4, "hidden": 512, "intermediate": 16384, "heads": 8, "kv_heads": 2},
    # Llama's proportions at a size a CPU runs (hidden 768, MLP 2048): ~50% attention at 8k tokens. 39M parameters,
    # 12 KiB of KV per token.
    "llama-small": {"layers": 6, "hidden": 768, "intermediate": 2048, "heads": 12, "kv_heads": 4},
}
INITIALIZER_RANGE = 0.02
# Two clusters side by side, pdcluster's CPU attention on in one and off in the other (cluster.cpu_attention), so
# that every measurement can alternate between them. 29xxx: below the ephemeral range (32768+), not the tests'.
PORTS = {"on": {"bootstrap": 14998, "router": 14000, "prefill": 14300, "kv_bootstrap": 14301, "decode": 14400},
         "off": {"bootstrap": 14997, "router": 14001, "prefill": 14310, "kv_bootstrap": 14311, "decode": 14410}}
PAGE = 64


def build_model(shape: str) -> Path:
    """One of SHAPES, built once by scripts/build_demo_model.py (the demo model's tokenizer, random weights)."""
    out = REPO / "models" / f"persistence-bench-{shape}"
    dims = {**SHAPES[shape], "max_positions": MAX_POSITIONS}
    options = [f"--{k.replace('_', '-')}={v}" for k, v in dims.items()]
    subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(out), *options,
                    f"--initializer-range={INITIALIZER_RANGE}"], cwd=REPO, check=True)
    return out


def model_info(path: Path, longest: int) -> dict:
    config = json.loads((path / "config.json").read_text())
    info = json.loads((path / "build-info.json").read_text()) if (path / "build-info.json").is_file() else {}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers, hidden, inter = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    q_dim, kv_dim, n = heads * head_dim, kv_heads * head_dim, longest
    dense = n * layers * (2 * hidden * q_dim + 2 * hidden * kv_dim + 3 * hidden * inter)  # projections + MLP
    attention = layers * 2 * (n * n // 2) * q_dim  # QK^T and PV over the causal half, every query head
    return {"path": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
            "dims": {"layers": layers, "hidden": hidden, "intermediate": inter, "heads": heads, "kv_heads": kv_heads,
                     "head_dim": head_dim},
            "parameters": info.get("num_parameters"), "dtype": "float32", "vocab_size": config["vocab_size"],
            "max_positions": config["max_position_embeddings"], "kv_bytes_per_token": layers * 2 * kv_dim * 4,
            f"attention_share_of_prefill_at_{n}": round(attention / (attention + dense), 3)}


def write_configs(model: Path, mode: str) -> LocalSpec:
    """The cluster of one mode: its configs, KV directory and logs under WORK/<mode>."""
    ports, work = PORTS[mode], WORK / mode
    (work / "kv").mkdir(parents=True)
    positions = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    for role in ("prefill", "decode"):
        raw = yaml.safe_load((REPO / "configs" / f"{role}-persistent.yaml").read_text())
        # The prefill's KV pool of 20k tokens keeps every prompt of a repeat in memory (the "memory" series) and a
        # chat's next turn (the CPU profile's 64k would make SGLang's HiCache ask for a host pool twice that size).
        # The decode holds one request at a time: the context, SGLang's 512-token reserve and a page suffice, and
        # on SmolLM2 (45 KiB a token, a HiCache host pool twice the pool) that leaves RAM for the second cluster,
        # whose decode once got too little to start.
        pool = 20480 if role == "prefill" else min(20480, positions + 512 + PAGE)
        raw.update({"model-path": str(model), "served-model-name": SERVED, "log-level": "warning",
                    "max-total-tokens": pool, "dtype": "float32"})
        raw["cluster"].update({"bootstrap_url": f"http://127.0.0.1:{ports['bootstrap']}",
                               "cpu_attention": mode == "on"})
        raw["cluster"]["kv_store"]["dir"] = str(work / "kv")  # decode_offload stays on: a chat's next turn
        (work / f"{role}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    router = {"host": "127.0.0.1", "port": ports["router"], "bootstrap_url": f"http://127.0.0.1:{ports['bootstrap']}",
              "read_timeout": 1800, "first_byte_timeout": 1800, "first_token_timeout": 1800, "log_level": "warning",
              # A prefill computing a 4096-token chunk on a CPU reports no progress for many seconds: not a hang.
              "stall_timeout": 600}
    (work / "router.yaml").write_text(yaml.safe_dump(router))
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=ports["bootstrap"]),
        router=ComponentSpec(config=str(work / "router.yaml"), port=ports["router"]),
        prefill=WorkerGroupSpec(config=str(work / "prefill.yaml"), count=1, first_port=ports["prefill"],
                                first_kv_bootstrap_port=ports["kv_bootstrap"]),
        decode=WorkerGroupSpec(config=str(work / "decode.yaml"), count=1, first_port=ports["decode"]),
        log_dir=str(work / "logs"), ready_timeout=900)


def settle(dirs: list[Path], quiet: float = 2.0, timeout: float = 120) -> None:
    """Wait until the workers' background writers have put every page on disk."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = sorted(str(p) for d in dirs for p in d.glob("*/*") if p.name.endswith((".bin", ".tmp")))
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


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy over `seconds` just before a measurement (anything else running on the machine shows here)."""
    return round(cpu.busy_cores(seconds), 2)


class Side:
    """One mode's cluster: bootstrap service, router, 1 prefill + 1 decode."""

    def __init__(self, model: Path, mode: str):
        spec = write_configs(model, mode)
        self.mode, self.kv = mode, WORK / mode / "kv"
        self.cluster = LocalCluster(spec, Path(spec.log_dir))
        self.client = httpx.Client(base_url=spec.router_url, timeout=1800)
        self.prefill_url = f"http://127.0.0.1:{PORTS[mode]['prefill']}"
        self.ids = {"prefill-0": f"prefill-127.0.0.1-{PORTS[mode]['prefill']}",
                    "decode-0": f"decode-127.0.0.1-{PORTS[mode]['decode']}"}

    def namespace_files(self) -> list[Path]:
        return sorted(self.kv.glob("*/*.bin"))

    def start(self) -> None:
        self.cluster.start()
        self.cluster.wait_ready()

    def check_pool(self, longest: int) -> None:
        """Stop at once when the decode's KV pool cannot take the longest prompt: SGLang sizes it from the RAM free at
        its start (the second cluster's once got 4352 tokens), and the router would refuse every such prompt."""
        budget = next(w["prompt_budget"] for w in self.client.get("/ready").json()["workers"]
                      if w["worker_id"] == self.ids["decode-0"])
        if budget is not None and budget < longest:
            raise RuntimeError(f"{self.mode} decode's KV pool takes prompts of at most {budget} tokens, not the "
                               f"{longest} this benchmark sends: free RAM before running it (its log: "
                               f"{self.cluster.processes['decode-0'].log_path})")

    def stop(self) -> None:
        self.client.close()
        self.cluster.stop(timeout=60)

    def restart_prefill(self) -> float:
        """SIGTERM, wait for it to go, start it again, wait for the router to take it back; seconds it took."""
        process, started = self.cluster.processes["prefill-0"], time.monotonic()
        process.signal(signal.SIGTERM)
        process.popen.wait(timeout=120)
        while self._healthy().get(self.ids["prefill-0"]):
            time.sleep(0.2)
        process.start()
        while not self._healthy().get(self.ids["prefill-0"]):
            if not process.running:
                raise RuntimeError(f"{self.mode} prefill exited ({process.popen.returncode}):\n{process.tail(30)}")
            time.sleep(0.5)
        return round(time.monotonic() - started, 1)

    def wait_healthy(self, timeout: float = 300) -> None:
        """Both workers healthy in the router's view. A prefill busy for more than 20 s (a cold 8k prompt on a loaded
        machine) fails SGLang's own /health, whose one-token generation waits behind it: the registry then marks it
        unhealthy until its next probe, and a request sent at once would get a 503, not a measurement."""
        deadline = time.monotonic() + timeout
        while not all(self._healthy().get(i) for i in self.ids.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mode} workers not healthy after {timeout:.0f}s: {self._healthy()}")
            time.sleep(0.2)

    def _healthy(self) -> dict:
        try:
            # Usable, not just healthy: a restarted prefill is a new instance, which gets no request until its
            # admission canary passes (a request sent before is a 503).
            return {w["worker_id"]: not w["unusable"] for w in self.client.get("/ready").json()["workers"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}

    def flush_memory_tiers(self) -> None:
        httpx.post(f"{self.prefill_url}/flush_cache", params={"timeout": 60}, timeout=120).raise_for_status()

    def server_info(self) -> dict:
        info = httpx.get(f"{self.prefill_url}/server_info", timeout=30).json()
        return {k: info.get(k) for k in ("chunked_prefill_size", "max_prefill_tokens", "page_size", "attention_backend",
                                         "version")}
