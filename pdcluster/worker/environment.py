"""The environment SGLang is started with: what every worker gets, the CPU profile's part, the kv_store LRU bound's,
the cores' thread count. plan.py decides the rest of the launch (the options, the command, the registration) and
calls `sglang_env` with what it decided.

What the plan adds replaces the launcher's own environment only for the keys a setting decides (SETTING_DECIDES); for
the others an export already there wins.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
from pathlib import Path

from pdcluster.worker.settings import ClusterSettings, KVStoreSettings

# Package data (pyproject.toml), so it is there in an installed wheel as in a checkout.
CPU_SHIM_DIR = Path(__file__).resolve().parent.parent / "plugins" / "cpu_shim"
# The CPU profile's environment for both roles (each role adds its own CPU_ENV); its SGLang options are plan.py's
# CPU_FLAGS.
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# cluster.cpu_attention, read by pdcluster/plugins/cpu_attention in SGLang
CPU_ATTENTION_ENV = "PDCLUSTER_CPU_ATTENTION"
THREADS_ENV = "OMP_NUM_THREADS"  # cluster.cpus: torch's intra-op threads, one per core the worker is given
# A CPU worker not given cores of its own shares them with the host's other workers (`make up`, compose's CPU profile:
# a prefill and a decode on the same cores). torch's OpenMP threads then spin at every barrier on cores the other
# worker computes on, and each slows the other: measured with SmolLM2 on 2 cores (`make bench-n`), n = 4 choices took
# 6.7 s against 4.6 s with passive waiting, which costs a lone request ~10% (n = 1: 3.0 -> 3.3 s). An export wins.
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SETTING_DECIDES = ("PYTHONPATH", CPU_ATTENTION_ENV, THREADS_ENV)
# SGLang's /health waits for any output of the scheduler and, after 20 s without one, answers 503 and marks the
# server unhealthy (which also makes a later SIGTERM skip the drain). One long forward pass (a long prompt on a CPU)
# is silent for that long: judging a busy scheduler is the router's liveness's job (router/fleet/liveness.py), so
# SGLang's own limit is set far above any probe's timeout.
# PDCLUSTER_THREAD_GUARD: a worker whose KV-transfer thread died ends instead of serving on
# (pdcluster/plugins/thread_guard.py).
# PDCLUSTER_FLIPPED_PREFILL: a decode connects anew to a prefill whose role was flipped and back
# (pdcluster/plugins/flipped_prefill).
# SGLANG_SANITIZE_NAN_LOGITS: a grammar that admits no token (`root ::= root`, or a dead end after some tokens) masks
# every logit to -inf; sampled (not greedy), its probabilities are NaN and torch.multinomial raises in the scheduler,
# which kills the worker. Sanitized, the masked logits are -1e30: the sampled token is refused by the grammar and SGLang
# aborts that one request ("Grammar accept_token failed", a 400 from the router). Finite logits are left as they are.
COMMON_ENV = {"MC_LOG_LEVEL": "ERROR", "SGLANG_HEALTH_CHECK_TIMEOUT": "600", "PDCLUSTER_THREAD_GUARD": "1",
              "PDCLUSTER_FLIPPED_PREFILL": "1", "SGLANG_SANITIZE_NAN_LOGITS": "1"}
# Mooncake's TCP transport rejects a whole batch (the hand-off fails, nothing retried) once more than 1024 queued +
# 1024 pending transfers wait for one peer; SGLang sends one transfer per run of pages per KV tensor, so a 2.2k-token
# SmolLM2 prompt on scattered pages (a churned decode pool) already fails. Measured in bench.kv_handoff: 16384 and
# 32768 carry an 8k-token SmolLM2 prompt on scattered pages (7680 transfers); 65536 is refused like the default.
MOONCAKE_TCP_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "32768"}


def sglang_env(cluster: ClusterSettings, ns: argparse.Namespace, advertise: str, cores: list[int],
               stored: KVStoreSettings | None, role_cpu_env: dict[str, str] | None,
               env: dict[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """SGLang's whole environment (`env`, or this process's, with the plan's additions), and what of it the plan
    decided. `ns`: SGLang's final options; `stored`: the KV store the worker writes to, if any; `role_cpu_env`: on
    CPU, the role's CPU_ENV (None off CPU)."""
    env_added = {**COMMON_ENV, **(MOONCAKE_TCP_ENV if ns.disaggregation_transfer_backend == "mooncake_tcp" else {}),
                 **cluster.env}
    env_added["SGLANG_HOST_IP"] = advertise  # Mooncake and SGLang's ZMQ endpoints bind/announce this address
    if role_cpu_env is not None:
        env_added.update(_cpu_env(cluster, role_cpu_env, env))
        if unused := unused_model_modules(ns.model_path):
            env_added[DISABLED_MODELS_ENV] = ",".join(unused)
    if stored is not None:
        env_added.update(_kv_store_env(stored, ns.tp_size * ns.pp_size))
    if cores:
        env_added[THREADS_ENV] = str(len(cores))
    elif role_cpu_env is not None:
        env_added[WAIT_POLICY_ENV] = "PASSIVE"
    final_env = dict(env or os.environ)
    for key, value in env_added.items():
        if key in SETTING_DECIDES or key not in final_env:  # the setting decides, not a stray export
            final_env[key] = value
    return final_env, {k: final_env[k] for k in env_added}


def _cpu_env(cluster: ClusterSettings, role_cpu_env: dict[str, str], env: dict[str, str] | None) -> dict[str, str]:
    """The CPU profile's: the role's variables, the stand-in sgl_kernel first on PYTHONPATH, and which of pdcluster's
    SGLang plugins act."""
    added = CPU_ENV | role_cpu_env
    base = (env or os.environ).get("PYTHONPATH")
    added["PYTHONPATH"] = f"{CPU_SHIM_DIR}{os.pathsep}{base}" if base else str(CPU_SHIM_DIR)
    if cluster.kv_store is not None:
        added["PDCLUSTER_CPU_HICACHE"] = "1"  # pdcluster/plugins/cpu_hicache adapts HiCache to CPU
    # pdcluster/plugins/cpu_attention: extend attention of the new tokens only, batched decode
    added[CPU_ATTENTION_ENV] = "1" if cluster.cpu_attention else "0"
    # pdcluster/plugins/cpu_transfer_race: the prefill's transfer loop survives SGLang's clean-up race
    added["PDCLUSTER_CPU_TRANSFER_RACE"] = "1"
    # pdcluster/plugins/cpu_fork: SGLang's processes forked, not spawned (no second import of SGLang)
    added["PDCLUSTER_CPU_FORK"] = "1"
    # pdcluster/plugins/cpu_idle_yield: a scheduler waiting on a hand-off leaves the cores to the other's
    added["PDCLUSTER_CPU_IDLE_YIELD"] = "1"
    # pdcluster/plugins/cpu_seeded_sampling: a request's seed decides its sampled tokens
    added["PDCLUSTER_CPU_SEEDED_SAMPLING"] = "1"
    return added


# SGLang's scheduler imports every module of sglang.srt.models to find the model's class (~300 modules, 3-4 s of each
# worker's start on a CPU, where starts are what the tests wait for); SGLang's own knob skips the ones named here.
DISABLED_MODELS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"


def unused_model_modules(model_path: str) -> list[str]:
    """The modules of sglang.srt.models that cannot hold the model's class: those whose source names none of its
    config.json `architectures` (a module subclassing or re-exporting the class names it, and is kept). [] when the
    model is not a local folder with architectures, or SGLang's models are not where they were (nothing skipped)."""
    try:
        architectures = json.loads((Path(model_path) / "config.json").read_text()).get("architectures")
        spec = importlib.util.find_spec("sglang.srt.models")
    except (OSError, ValueError, ImportError, AttributeError):
        return []
    if not architectures or not all(isinstance(a, str) and a.isidentifier() for a in architectures) \
            or spec is None or not spec.submodule_search_locations:
        return []
    named = re.compile(r"\b(?:" + "|".join(architectures) + r")\b")
    unused = []
    for source in sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.py")):
        if source.stem != "__init__" and not named.search(source.read_text(errors="replace")):
            unused.append(source.stem)
    return unused


def _kv_store_env(kv: KVStoreSettings, ranks: int) -> dict[str, str]:
    """SGLang's LRU evictor for the file storage. Each TP/PP rank bounds its own files, so each gets its share."""
    env = {}
    if kv.max_size:
        env["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] = str(max(1, int(kv.max_size) // ranks))
    if kv.min_free_space:
        env["SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"] = str(int(kv.min_free_space))
    return env
