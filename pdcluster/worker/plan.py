"""Decide, from a worker config, exactly how SGLang is started: its argv, its environment, what gets registered.

This is the one place where the role's flags and the CPU profile are applied. Order of precedence for every SGLang
option: command line > config file > profile defaults here.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from pdcluster.protocol import BOOTSTRAP_SERVICE_PORT, ModelIdentity, Role, WorkerRegistration
from pdcluster.worker import checks
from pdcluster.worker.options import ConfigError, SGLangOptions, load_yaml, sglang_parser
from pdcluster.worker.settings import ClusterSettings

CPU_SHIM_DIR = Path(__file__).resolve().parent.parent / "cpu_shim"
MOONCAKE_BACKENDS = {"mooncake", "mooncake_tcp"}

# Measured on a CPU-only x86 box with SGLang 0.5.23 (see docs/architecture.md, "CPU profile").
CPU_FLAGS = {
    "device": "cpu",
    "attention-backend": "torch_native",
    "cuda-graph-backend-decode": "disabled",
    "cuda-graph-backend-prefill": "disabled",
    "mem-fraction-static": 0.1,
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
        cluster = ClusterSettings.model_validate({**(raw.pop("cluster", None) or {}), **(cluster_overrides or {})})
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

    ns = options.parse()
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
    )
    command = [sys.executable, "-m", "sglang.launch_server", *options.argv()]
    return LaunchPlan(role, command, final_env, env_added, cluster, registration, cpu)


def _check_role(role: Role, options: SGLangOptions) -> None:
    mode = options.tokens.get("disaggregation_mode")
    if mode and mode[1:] != [role.value]:
        raise ConfigError(f"disaggregation-mode {' '.join(mode[1:])} contradicts this {role.value} worker")
    backend = options.tokens.get("disaggregation_transfer_backend")
    if role is Role.PREFILL and backend and backend[1:] == ["fake"]:
        raise ConfigError("disaggregation-transfer-backend fake is decode-only: a prefill must send real KV")
    if role is Role.DECODE and options.is_set("disaggregation_bootstrap_port"):
        raise ConfigError("disaggregation-bootstrap-port is a prefill option: a decode learns it per request")
