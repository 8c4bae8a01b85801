"""bench.persistence's model and cluster: the benchmark model, the worker configs, one local cluster whose prefill
and decode restart with pdcluster's CPU attention on or off, and what one request measures."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml

from pdcluster.local import REPO, ComponentSpec, LocalCluster, LocalSpec, WorkerGroupSpec

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
# 29xxx: below the ephemeral range (32768+), where a port can be taken by any outgoing connection; not the tests'.
PORTS = {"bootstrap": 29998, "router": 29000, "prefill": 29300, "kv_bootstrap": 29301, "decode": 29400}
PAGE = 64
WORKERS = ("prefill-0", "decode-0")


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


def write_configs(model: Path) -> LocalSpec:
    if WORK.exists():
        shutil.rmtree(WORK)
    (WORK / "kv").mkdir(parents=True)
    for role in ("prefill", "decode"):
        raw = yaml.safe_load((REPO / "configs" / f"{role}-persistent.yaml").read_text())
        # A KV pool of 20k tokens holds the longest prompt and a chat's next turn (the CPU profile's 64k would make
        # SGLang's HiCache ask for a host pool twice that size).
        raw.update({"model-path": str(model), "served-model-name": SERVED, "log-level": "warning",
                    "max-total-tokens": 20480, "dtype": "float32"})
        raw["cluster"]["bootstrap_url"] = f"http://127.0.0.1:{PORTS['bootstrap']}"
        raw["cluster"]["kv_store"]["dir"] = str(WORK / "kv")  # decode_offload stays on: a chat's next turn
        (WORK / f"{role}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    router = {"host": "127.0.0.1", "port": PORTS["router"], "bootstrap_url": f"http://127.0.0.1:{PORTS['bootstrap']}",
              "read_timeout": 1800, "first_byte_timeout": 1800, "first_token_timeout": 1800, "log_level": "warning",
              # A prefill computing a 4096-token chunk on a CPU reports no progress for many seconds: not a hang.
              "stall_timeout": 600}
    (WORK / "router.yaml").write_text(yaml.safe_dump(router))
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=PORTS["bootstrap"]),
        router=ComponentSpec(config=str(WORK / "router.yaml"), port=PORTS["router"]),
        prefill=WorkerGroupSpec(config=str(WORK / "prefill.yaml"), count=1, first_port=PORTS["prefill"],
                                first_kv_bootstrap_port=PORTS["kv_bootstrap"]),
        decode=WorkerGroupSpec(config=str(WORK / "decode.yaml"), count=1, first_port=PORTS["decode"]),
        log_dir=str(WORK / "logs"), ready_timeout=900)


def namespace_files() -> list[Path]:
    return sorted((WORK / "kv").glob("*/*.bin"))


def settle(quiet: float = 2.0, timeout: float = 120) -> None:
    """Wait until the workers' background writers have put every page on disk."""
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


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy over `seconds` just before a measurement (anything else running on the machine shows here)."""
    before = psutil.cpu_times()
    time.sleep(seconds)
    after = psutil.cpu_times()
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0) - getattr(before, "iowait", 0))
    return round((sum(after) - sum(before) - idle) / seconds, 2)


class Bench:
    def __init__(self, spec: LocalSpec):
        self.cluster = LocalCluster(spec, Path(spec.log_dir))
        self.client = httpx.Client(base_url=spec.router_url, timeout=1800)
        self.prefill_url = f"http://127.0.0.1:{PORTS['prefill']}"
        self.base = {name: list(self.cluster.processes[name].command) for name in WORKERS}
        self.ids = {"prefill-0": f"prefill-127.0.0.1-{PORTS['prefill']}",
                    "decode-0": f"decode-127.0.0.1-{PORTS['decode']}"}

    def start(self) -> None:
        self.cluster.start()
        self.cluster.wait_ready()

    def stop(self) -> None:
        self.client.close()
        self.cluster.stop(timeout=60)

    def restart(self, names: tuple[str, ...], cpu_attention: bool | None = None, empty_kv: bool = False) -> float:
        """SIGTERM, wait for them to go, start again (with cluster.cpu_attention set when given), wait for the router
        to take them back; seconds it took. empty_kv: the KV directory emptied meanwhile (nothing of it in use)."""
        started = time.monotonic()
        for name in names:
            process = self.cluster.processes[name]
            process.signal(signal.SIGTERM)
            process.popen.wait(timeout=120)
        while any(self._healthy().get(self.ids[n]) for n in names):
            time.sleep(0.2)
        if empty_kv:
            shutil.rmtree(WORK / "kv")
            (WORK / "kv").mkdir()
        for name in names:
            process = self.cluster.processes[name]
            if cpu_attention is not None:
                process.command = [*self.base[name], "--cluster", f"cpu_attention={str(cpu_attention).lower()}"]
            process.start()
        while not all(self._healthy().get(self.ids[n]) for n in names):
            for name in names:
                process = self.cluster.processes[name]
                if not process.running:
                    raise RuntimeError(f"{name} exited ({process.popen.returncode}):\n{process.tail(30)}")
            time.sleep(0.5)
        return round(time.monotonic() - started, 1)

    def _healthy(self) -> dict:
        try:
            return {w["worker_id"]: w["healthy"] for w in self.client.get("/ready").json()["workers"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}

    def flush_memory_tiers(self) -> None:
        httpx.post(f"{self.prefill_url}/flush_cache", params={"timeout": 60}, timeout=120).raise_for_status()

    def server_info(self) -> dict:
        info = httpx.get(f"{self.prefill_url}/server_info", timeout=30).json()
        return {k: info.get(k) for k in ("chunked_prefill_size", "max_prefill_tokens", "page_size", "attention_backend",
                                         "version")}
