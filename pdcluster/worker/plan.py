"""Decide, from a worker config, exactly how SGLang is started: its argv, its environment, what gets registered.

This is the one place where the role's flags and the CPU profile are applied. Order of precedence for every SGLang
option: command line > config file > profile defaults here.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from pdcluster.protocol import BOOTSTRAP_SERVICE_PORT, ModelIdentity, Role, WorkerRegistration
from pdcluster.worker import checks
from pdcluster.worker.options import ConfigError, SGLangOptions, load_yaml, sglang_parser
from pdcluster.worker.settings import ClusterSettings, KVStoreSettings

CPU_SHIM_DIR = Path(__file__).resolve().parent.parent / "cpu_shim"
MOONCAKE_BACKENDS = {"mooncake", "mooncake_tcp"}

# Measured on a CPU-only x86 box with SGLang 0.5.23 (see docs/architecture.md, "CPU profile").
CPU_FLAGS = {
    "device": "cpu",
    "attention-backend": "torch_native",
    "cuda-graph-backend-decode": "disabled",
    "cuda-graph-backend-prefill": "disabled",
    # SGLang refuses to start when free RAM after loading the weights is below (1 - this) x free RAM before: at 0.1
    # any other process taking 10% of the RAM meanwhile (another worker starting) killed the start. The KV pool is
    # capped by max-total-tokens anyway, so a larger fraction allocates nothing more.
    "mem-fraction-static": 0.5,
    "max-total-tokens": 65536,
    "disaggregation-transfer-backend": "mooncake_tcp",
}
CPU_ROLE_FLAGS = {
    Role.PREFILL: {"disable-overlap-schedule": True},  # else "dummy base class Event" on a prefix-cache hit
    Role.DECODE: {"disaggregation-decode-retraction-backup": "cpu_tensor"},  # else "Torch not compiled with CUDA"
}
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
CPU_ROLE_ENV = {Role.PREFILL: {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}, Role.DECODE: {}}
COMMON_ENV = {"MC_LOG_LEVEL": "ERROR"}

# cluster.kv_store: SGLang HiCache with its file storage, set so that KV really persists (pdcluster/kvstore/).
KV_PAGE_SIZE = 64  # 64 tokens per file; the decode must use the prefill's page size anyway
KV_PREFILL_FLAGS = {
    "enable-hierarchical-cache": True,
    "hicache-storage-backend": "file",
    "hicache-write-policy": "write_through",  # write_back never writes a prompt's first pages (sglang #26886)
}
KV_DECODE_FLAGS = {  # the decode writes the KV it generates; needs the storage backend, not enable-hierarchical-cache
    "disaggregation-decode-enable-offload-kvcache": True,
    "hicache-storage-backend": "file",
}
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


def cuda_available() -> bool:
    if not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return False  # cheap answer first: importing torch costs seconds
    import torch

    return torch.cuda.is_available()


def build_plan(role: Role, config_path: str | None, overrides: list[str], env: dict[str, str] | None = None,
               cluster_overrides: dict[str, str | None] | None = None) -> LaunchPlan:
    raw = load_yaml(config_path) if config_path else {}
    try:
        cluster = ClusterSettings.model_validate(_merge_cluster(raw.pop("cluster", None) or {}, cluster_overrides))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"cluster.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None

    options = SGLangOptions(sglang_parser())
    for key, value in raw.items():
        options.set_value(key, value)
    options.apply_argv(overrides)

    _check_role(role, options)
    options.set_value("disaggregation-mode", role.value)
    cpu = cluster.device == "cpu" or (cluster.device == "auto" and not cuda_available())
    if cpu:
        for key, value in {**CPU_FLAGS, **CPU_ROLE_FLAGS[role]}.items():
            options.set_default(key, value)
    options.set_default("disaggregation-transfer-backend", "mooncake")  # explicit, whatever SGLang's default
    kv = cluster.kv_store
    if kv is not None:
        options.set_default("page-size", KV_PAGE_SIZE)
        if role is Role.PREFILL or kv.decode_offload:
            for key, value in {**(KV_PREFILL_FLAGS if role is Role.PREFILL else KV_DECODE_FLAGS),
                               **KV_DEVICE_FLAGS[cpu]}.items():
                options.set_default(key, value)
        if role is Role.PREFILL:
            options.set_default("hicache-storage-backend-extra-config", {"prefetch_threshold": kv.prefetch_threshold})

    ns = options.parse()
    stores_kv = kv is not None and (role is Role.PREFILL or ns.disaggregation_decode_enable_offload_kvcache
                                    or ns.enable_hierarchical_cache)
    if stores_kv:
        checks.check_kv_store(role.value, ns, cpu)
        checks.check_kv_store_dir(kv.dir)
    if ns.disaggregation_transfer_backend not in MOONCAKE_BACKENDS | ({"fake"} if role is Role.DECODE else set()):
        raise ConfigError(f"disaggregation-transfer-backend {ns.disaggregation_transfer_backend}: pdcluster moves KV "
                          f"with Mooncake (mooncake, or mooncake_tcp without RDMA)")
    checks.check_model_path(ns.model_path)
    checks.check_port_free(ns.host, ns.port, "SGLang HTTP")
    advertise = checks.advertise_address(ns.host, cluster.advertise_host)

    bootstrap_port = None
    if role is Role.PREFILL:
        if options.is_set("disaggregation_bootstrap_port"):
            bootstrap_port = ns.disaggregation_bootstrap_port
            if bootstrap_port in (BOOTSTRAP_SERVICE_PORT, ns.port):
                raise ConfigError(f"disaggregation-bootstrap-port {bootstrap_port} collides with the "
                                  f"{'bootstrap service' if bootstrap_port == BOOTSTRAP_SERVICE_PORT else 'HTTP port'}")
            checks.check_port_free(ns.host, bootstrap_port, "SGLang KV bootstrap")
        else:
            bootstrap_port = checks.choose_kv_bootstrap_port(ns.host, cluster.kv_bootstrap_port_base, {ns.port})
            options.set_value("disaggregation-bootstrap-port", bootstrap_port)

    env_added = {**COMMON_ENV, **cluster.env}
    env_added["SGLANG_HOST_IP"] = advertise  # Mooncake and SGLang's ZMQ endpoints bind/announce this address
    if cpu:
        env_added.update(CPU_ENV | CPU_ROLE_ENV[role])
        base = (env or os.environ).get("PYTHONPATH")
        env_added["PYTHONPATH"] = f"{CPU_SHIM_DIR}{os.pathsep}{base}" if base else str(CPU_SHIM_DIR)
    if kv is not None and cpu:
        env_added["PDCLUSTER_CPU_HICACHE"] = "1"  # pdcluster/cpu_hicache (an SGLang plugin) adapts HiCache to CPU
    if stores_kv:
        env_added.update(_kv_store_env(kv, ns.tp_size * ns.pp_size))
    final_env = dict(env or os.environ)
    for key, value in env_added.items():
        if key == "PYTHONPATH" or key not in final_env:
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
        bootstrap_host=advertise if role is Role.PREFILL else None,
        bootstrap_port=bootstrap_port,
        tp_size=ns.tp_size,
        dp_size=ns.dp_size,
        max_total_tokens=ns.max_total_tokens,
        **_model_limits(ns.model_path, ns.context_length),
    )
    command = [sys.executable, "-m", "sglang.launch_server", *options.argv()]
    if stores_kv:  # prepares the namespace and builds the page-hash extension, then execs SGLang (kvstore/launch.py)
        command = [sys.executable, "-m", "pdcluster.kvstore", "launch", "--role", role.value,
                   "--dir", os.path.abspath(os.path.expanduser(kv.dir)),
                   "--orphan-tmp-age", str(kv.orphan_tmp_age), "--", *command]
    return LaunchPlan(role, command, final_env, env_added, cluster, registration, cpu)


def _merge_cluster(section: dict, overrides: dict[str, str | None] | None) -> dict:
    """The file's cluster: section with --cluster overrides; `kv_store.max_size=10GiB` sets one key of a subsection."""
    merged = dict(section)
    for key, value in (overrides or {}).items():
        head, dot, rest = key.partition(".")
        if dot:
            sub = merged.get(head)
            merged[head] = {**({"dir": sub} if isinstance(sub, str) else sub or {}), rest: value}
        else:
            merged[key] = value
    return merged


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
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def pick(key: str) -> int | None:
        value = config.get(key, text.get(key))
        return value if isinstance(value, int) and value > 0 else None

    return {"vocab_size": pick("vocab_size"), "context_length": context_length or pick("max_position_embeddings")}


def _check_role(role: Role, options: SGLangOptions) -> None:
    mode = options.tokens.get("disaggregation_mode")
    if mode and mode[1:] != [role.value]:
        raise ConfigError(f"disaggregation-mode {' '.join(mode[1:])} contradicts this {role.value} worker")
    backend = options.tokens.get("disaggregation_transfer_backend")
    if role is Role.PREFILL and backend and backend[1:] == ["fake"]:
        raise ConfigError("disaggregation-transfer-backend fake is decode-only: a prefill must send real KV")
    if role is Role.DECODE and options.is_set("disaggregation_bootstrap_port"):
        raise ConfigError("disaggregation-bootstrap-port is a prefill option: a decode learns it per request")
