"""Decide, from a worker config, exactly how SGLang is started: its argv, its environment, what gets registered.

`build_plan` takes the same steps for both roles, with what they share: the CPU profile, the kv_store wiring and the
checks of checks.py. What one role adds (its part of the CPU profile, its kv_store options and checks, its KV
bootstrap server) is in its own folder, prefill/plan.py or decode/plan.py: a `RoleRules`, which the role's entry point
passes in. This module never imports its users, so `pdcluster` stands on its own. Order of precedence for every SGLang
option: command line > config file > the defaults applied here and by the role.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import TypeAdapter, ValidationError

from pdcluster.config_file import ConfigError, load_yaml, validation_message
from pdcluster.kvstore import wiring
from pdcluster.protocol import ModelIdentity, Role, WorkerRegistration
from pdcluster.worker import checks
from pdcluster.worker.options import SGLangOptions, sglang_parser
from pdcluster.worker.settings import ClusterSettings, KVStoreSettings


class RoleRules(Protocol):
    """What differs between the roles. The modules prefill/plan.py and decode/plan.py are its two implementations."""

    ROLE: Role
    CPU_FLAGS: dict[str, Any]  # the role's part of the CPU profile: SGLang options, set when no source sets them
    CPU_ENV: dict[str, str]  # ... and environment
    EXTRA_TRANSFER_BACKENDS: frozenset[str]  # what it accepts besides Mooncake

    def check_options(self, options: SGLangOptions) -> None:
        """Refuse a configured SGLang option that contradicts the role (before any default is applied)."""

    def kv_store_flags(self, kv: KVStoreSettings, device_flags: dict[str, Any]) -> dict[str, Any]:
        """The SGLang options (set when unset) by which the role writes to and reads from kv_store; {}: it does not.
        `device_flags`: HiCache's host layout and io backend on this device, which both roles use."""

    def stores_kv(self, ns: argparse.Namespace) -> bool:
        """With kv_store on, whether the final options (`ns`, as SGLang parsed them) read or write the store."""

    def check_kv_store(self, ns: argparse.Namespace) -> None:
        """Refuse final options that would defeat the store for this role."""

    def kv_bootstrap_port(self, options: SGLangOptions, ns: argparse.Namespace,
                          cluster: ClusterSettings) -> int | None:
        """The port of the role's SGLang KV bootstrap server (one it chose is set in `options`); None: it runs none."""


# Package data (pyproject.toml), so it is there in an installed wheel as in a checkout.
CPU_SHIM_DIR = Path(__file__).resolve().parent.parent / "cpu_shim"
MOONCAKE_BACKENDS = {"mooncake", "mooncake_tcp"}

# The CPU profile both roles get (each role adds its own CPU_FLAGS and CPU_ENV). Measured on a CPU-only x86 box with
# SGLang 0.5.23 (see docs/architecture.md, "CPU profile").
CPU_FLAGS = {
    "device": "cpu",
    "attention-backend": "torch_native",
    "cuda-graph-backend-decode": "disabled",
    "cuda-graph-backend-prefill": "disabled",
    # SGLang refuses to start when free RAM after loading the weights is below (1 - this) x free RAM before: at 0.1
    # any other process taking 10% of the RAM meanwhile (another worker starting) killed the start. The KV pool is
    # capped by max-total-tokens anyway, so a larger fraction allocates nothing more.
    "mem-fraction-static": 0.5,
    # Sized for the default model, SmolLM2-135M-Instruct: 45 KiB of float32 KV a token, so 720 MiB per worker (65536
    # would reserve 2.8 GiB), and SGLang's HiCache host pool (kv_store) is twice the device pool.
    "max-total-tokens": 16384,
    "disaggregation-transfer-backend": "mooncake_tcp",
}
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# SGLang's /health waits for any output of the scheduler and, after 20 s without one, answers 503 and marks the
# server unhealthy (which also makes a later SIGTERM skip the drain). One long forward pass (a long prompt on a CPU)
# is silent for that long: judging a busy scheduler is the router's liveness's job (router/liveness.py), so SGLang's
# own limit is set far above any probe's timeout.
CPU_ATTENTION_ENV = "PDCLUSTER_CPU_ATTENTION"  # cluster.cpu_attention, read by pdcluster/cpu_attention in SGLang
TASKSET = "taskset"  # util-linux: on every Linux host and in the images
THREADS_ENV = "OMP_NUM_THREADS"  # cluster.cpus: torch's intra-op threads, one per core the worker is given
SETTING_DECIDES = ("PYTHONPATH", CPU_ATTENTION_ENV, THREADS_ENV)
# PDCLUSTER_THREAD_GUARD: a worker whose KV-transfer thread died ends instead of serving on (pdcluster/thread_guard.py).
COMMON_ENV = {"MC_LOG_LEVEL": "ERROR", "SGLANG_HEALTH_CHECK_TIMEOUT": "600", "PDCLUSTER_THREAD_GUARD": "1"}
# Mooncake's TCP transport rejects a whole batch (the hand-off fails, nothing retried) once more than 1024 queued +
# 1024 pending transfers wait for one peer; SGLang sends one transfer per run of pages per KV tensor, so a 2.2k-token
# SmolLM2 prompt on scattered pages (a churned decode pool) already fails. Measured in bench.kv_handoff: 16384 and
# 32768 carry an 8k-token SmolLM2 prompt on scattered pages (7680 transfers); 65536 is refused like the default.
MOONCAKE_TCP_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "32768"}

# cluster.kv_store: SGLang HiCache with its file storage, set so that KV really persists (pdcluster/kvstore/). What
# each role sets for it is its KV_STORE_FLAGS; what both share is here.
KV_PAGE_SIZE = 64  # 64 tokens per file; the decode must use the prefill's page size anyway
# CPU: only the direct io backend exists (pdcluster/cpu_hicache adapts it). GPU: SGLang's kernel io backend with the
# page_first layout its HiCache guide recommends for storage backends (a page is contiguous across layers).
KV_DEVICE_FLAGS = {True: {"hicache-io-backend": "direct", "hicache-mem-layout": "page_first_direct"},
                   False: {"hicache-mem-layout": "page_first"}}


@dataclass
class LaunchPlan:
    role: Role
    command: list[str]
    env: dict[str, str]
    env_added: dict[str, str]
    cluster: ClusterSettings
    registration: WorkerRegistration
    cpu: bool

    @property
    def health_url(self) -> str:
        return f"{self.registration.base_url}/health"

    def describe(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env_added.items()))
        return f"{env} {shlex.join(self.command)}".strip()

    def to_json(self) -> str:
        """The plan as the lean launcher reads it back (pdcluster/worker/cli.py: `run_plan`)."""
        return _PLAN_JSON.dump_json(self).decode()

    @classmethod
    def from_json(cls, text: str) -> LaunchPlan:
        return _PLAN_JSON.validate_json(text)


_PLAN_JSON = TypeAdapter(LaunchPlan)  # every field, validated on the way back in (no field list to keep by hand)


def cuda_available() -> bool:
    if not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return False  # cheap answer first: importing torch costs seconds
    import torch

    return torch.cuda.is_available()


def build_plan(rules: RoleRules, config_path: str | None, overrides: list[str], env: dict[str, str] | None = None,
               cluster_overrides: dict[str, str | None] | None = None) -> LaunchPlan:
    role = rules.ROLE
    raw = load_yaml(config_path) if config_path else {}
    cluster = _cluster_settings(raw.pop("cluster", None) or {}, cluster_overrides)

    options = SGLangOptions(sglang_parser())
    for key, value in raw.items():
        options.set_value(key, value)
    options.apply_argv(overrides)

    mode = options.tokens.get("disaggregation_mode")
    if mode and mode[1:] != [role.value]:
        raise ConfigError(f"disaggregation-mode {' '.join(mode[1:])} contradicts this {role.value} worker")
    rules.check_options(options)
    options.set_value("disaggregation-mode", role.value)
    cpu = cluster.device == "cpu" or (cluster.device == "auto" and not cuda_available())
    if cpu:
        for key, value in {**CPU_FLAGS, **rules.CPU_FLAGS}.items():
            options.set_default(key, value)
    options.set_default("disaggregation-transfer-backend", "mooncake")  # explicit, whatever SGLang's default
    kv = cluster.kv_store
    if kv is not None:
        options.set_default("page-size", KV_PAGE_SIZE)
        for key, value in rules.kv_store_flags(kv, KV_DEVICE_FLAGS[cpu]).items():
            options.set_default(key, value)
        _wire_sealed_storage(options, kv)

    ns = options.parse()
    stored = kv if kv is not None and rules.stores_kv(ns) else None  # the KV store this worker writes to, if any
    if stored is not None:
        checks.check_kv_store(ns, cpu, rules.check_kv_store)
        checks.check_kv_store_dir(stored.dir)
    if ns.disaggregation_transfer_backend not in MOONCAKE_BACKENDS | rules.EXTRA_TRANSFER_BACKENDS:
        raise ConfigError(f"disaggregation-transfer-backend {ns.disaggregation_transfer_backend}: pdcluster moves KV "
                          f"with Mooncake (mooncake, or mooncake_tcp without RDMA)")
    checks.check_model_path(ns.model_path)
    checks.check_port_free(ns.host, ns.port, "SGLang HTTP")
    advertise = checks.advertise_address(ns.host, cluster.advertise_host)
    kv_bootstrap_port = rules.kv_bootstrap_port(options, ns, cluster)

    env_added = {**COMMON_ENV, **(MOONCAKE_TCP_ENV if ns.disaggregation_transfer_backend == "mooncake_tcp" else {}),
                 **cluster.env}
    env_added["SGLANG_HOST_IP"] = advertise  # Mooncake and SGLang's ZMQ endpoints bind/announce this address
    if cpu:
        env_added.update(CPU_ENV | rules.CPU_ENV)
        base = (env or os.environ).get("PYTHONPATH")
        env_added["PYTHONPATH"] = f"{CPU_SHIM_DIR}{os.pathsep}{base}" if base else str(CPU_SHIM_DIR)
    if kv is not None and cpu:
        env_added["PDCLUSTER_CPU_HICACHE"] = "1"  # pdcluster/cpu_hicache (an SGLang plugin) adapts HiCache to CPU
    if cpu:  # pdcluster/cpu_attention (an SGLang plugin): extend attention of the new tokens only
        env_added[CPU_ATTENTION_ENV] = "1" if cluster.cpu_attention else "0"
        # pdcluster/cpu_transfer_race (an SGLang plugin): the prefill's transfer loop survives SGLang's clean-up race
        env_added["PDCLUSTER_CPU_TRANSFER_RACE"] = "1"
    if stored is not None:
        env_added.update(_kv_store_env(stored, ns.tp_size * ns.pp_size))
    cores = checks.check_cpus(cluster)
    if cores:
        env_added[THREADS_ENV] = str(len(cores))
    final_env = dict(env or os.environ)
    for key, value in env_added.items():
        if key in SETTING_DECIDES or key not in final_env:  # the setting decides, not a stray export
            final_env[key] = value
    env_added = {k: final_env[k] for k in env_added}

    registration = WorkerRegistration(
        worker_id=cluster.worker_id or f"{role.value}-{advertise}-{ns.port}",
        role=role,
        url=f"http://{advertise}:{ns.port}",
        identity=ModelIdentity(
            model_path=ns.model_path,
            served_model_name=ns.served_model_name or ns.model_path,
            page_size=ns.page_size or 1,
            kv_cache_dtype=ns.kv_cache_dtype,
            transfer_backend=ns.disaggregation_transfer_backend,
        ),
        bootstrap_host=advertise if kv_bootstrap_port is not None else None,
        bootstrap_port=kv_bootstrap_port,
        **_model_limits(ns.model_path, ns.context_length),
        instance_id=uuid.uuid4().hex,
    )
    command = [sys.executable, "-m", "sglang.launch_server", *options.argv()]
    # With a KV store: prepares the namespace and builds the page-hash extension, then execs SGLang (kvstore/launch.py)
    if stored is not None:
        command = [sys.executable, "-m", "pdcluster.kvstore", "launch", "--role", role.value,
                   "--dir", os.path.abspath(os.path.expanduser(stored.dir)),
                   "--orphan-tmp-age", str(stored.orphan_tmp_age), "--", *command]
    if cores:  # taskset execs the command on those cores: every process and thread it starts inherits them
        command = [TASKSET, "--cpu-list", ",".join(map(str, cores)), *command]
    return LaunchPlan(role, command, final_env, env_added, cluster, registration, cpu)


def _cluster_settings(section: object, overrides: dict[str, str | None] | None) -> ClusterSettings:
    """The file's cluster: section with the --cluster overrides on top, validated."""
    if isinstance(section, dict):
        section = _merge_cluster(section, overrides)
    try:
        return ClusterSettings.model_validate(section)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, section="cluster")) from None


def _merge_cluster(section: dict, overrides: dict[str, str | None] | None) -> dict:
    """`kv_store.max_size=10GiB` sets one key of a subsection."""
    merged = dict(section)
    for key, value in (overrides or {}).items():
        head, dot, rest = key.partition(".")
        if dot:
            sub = merged.get(head)
            merged[head] = {**({"dir": sub} if isinstance(sub, str) else sub or {}), rest: value}
        else:
            merged[key] = value
    return merged


def _wire_sealed_storage(options: SGLangOptions, kv: KVStoreSettings) -> None:
    """Where the role stores KV, SGLang loads pdcluster's sealed storage (pdcluster/kvstore/wiring.py), and serves
    /metrics, where that storage's rejections and failed writes are counted."""
    backend = options.tokens.get("hicache_storage_backend", [])[1:]
    if backend != [wiring.BACKEND]:
        return  # the role stores nothing, or the file set another backend: check_kv_store refuses that
    configured = options.tokens.get(wiring.EXTRA_CONFIG, [None, None])[1]
    options.set_value("hicache-storage-backend-extra-config", wiring.extra_config(configured, kv.secret_file))
    options.set_default("enable-metrics", True)


def _kv_store_env(kv: KVStoreSettings, ranks: int) -> dict[str, str]:
    """SGLang's LRU evictor for the file storage. Each TP/PP rank bounds its own files, so each gets its share."""
    env = {}
    if kv.max_size:
        env["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] = str(max(1, int(kv.max_size) // ranks))
    if kv.min_free_space:
        env["SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"] = str(int(kv.min_free_space))
    return env


def _model_limits(model_path: str, context_length: int | None) -> dict[str, int | None]:
    """vocab_size and context_length from a local model folder's config.json (None when unknown)."""
    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}

    def pick(key: str) -> int | None:
        value = config.get(key, text.get(key))
        return value if isinstance(value, int) and value > 0 else None

    return {"vocab_size": pick("vocab_size"), "context_length": context_length or pick("max_position_embeddings")}

