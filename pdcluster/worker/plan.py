"""Decide, from a worker config, exactly how SGLang is started: its argv, its environment, what gets registered.

`build_plan` takes the same steps for both roles, with what they share: the cluster: section (settings.py), the CPU
profile, the kv_store wiring, the environment (environment.py), the checks of checks.py and the registration
(registration.py). What one role adds (its part of the CPU profile, its kv_store options and checks, its KV bootstrap
server) is in its own folder, prefill/plan.py or decode/plan.py: a `RoleRules`, which the role's entry point passes in.
This module never imports its users, so `pdcluster` stands on its own. Order of precedence for every SGLang option:
command line > config file > the defaults applied here and by the role.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import TypeAdapter

from pdcluster.common.config_file import ConfigError, load_yaml
from pdcluster.common.protocol import Role, WorkerRegistration
from pdcluster.common.sglang_args import sglang_parser
from pdcluster.kvstore import wiring
from pdcluster.worker import checks, environment, switching, tracing
from pdcluster.worker.kv_events import plan_kv_events
from pdcluster.worker.options import SGLangOptions
from pdcluster.worker.registration import build_registration
from pdcluster.worker.settings import ClusterSettings, KVStoreSettings, cluster_settings


class RoleRules(Protocol):
    """What differs between the roles. The modules prefill/plan.py and decode/plan.py are its two implementations."""

    ROLE: Role
    CPU_FLAGS: dict[str, Any]  # the role's part of the CPU profile: SGLang options, set when no source sets them
    CPU_ENV: dict[str, str]  # ... and environment
    EXTRA_TRANSFER_BACKENDS: frozenset[str]  # what it accepts besides Mooncake
    PUBLISHES_KV_EVENTS: bool  # its radix cache's KV events are for the routers (pdcluster/worker/kv_events.py)

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


MOONCAKE_BACKENDS = {"mooncake", "mooncake_tcp"}

# The CPU profile's SGLang options for both roles (each role adds its own CPU_FLAGS; the profile's environment is
# environment.py's). Measured on a CPU-only x86 box with SGLang 0.5.23 (see docs/cpu.md).
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
TASKSET = "taskset"  # util-linux: on every Linux host and in the images

# cluster.kv_store: SGLang HiCache with its file storage, set so that KV really persists (pdcluster/kvstore/). What
# each role sets for it is its KV_STORE_FLAGS; what both share is here.
KV_PAGE_SIZE = 64  # 64 tokens per file; the decode must use the prefill's page size anyway
# CPU: only the direct io backend exists (pdcluster/plugins/cpu_hicache adapts it). GPU: SGLang's kernel io backend with
# the page_first layout its HiCache guide recommends for storage backends (a page is contiguous across layers).
# CPU, reading stored pages: SGLang's default prefetch policy (best_effort) lets a request start as soon as it can,
# with whatever pages have landed, and they land in batches of up to 128 (8192 tokens at page size 64): a long
# prompt read from a cold disk and checked page by page came too late and was recomputed whole (bench/README.md, KV
# persistence). On a CPU, recomputing costs ~10 s per 1k tokens (SmolLM2 on 2 cores) and reading them well under
# one: the request waits for its pages, up to a budget (wiring.PREFETCH_BUDGET) far below recomputing them.
KV_DEVICE_FLAGS = {True: {"hicache-io-backend": "direct", "hicache-mem-layout": "page_first_direct",
                          "hicache-storage-prefetch-policy": "timeout"},
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
    flip: switching.FlipPlan | None = None  # switch-enabled: what it registers as a prefill (switching.py)

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
    cluster = cluster_settings(raw.pop("cluster", None) or {}, cluster_overrides)
    options = _role_options(rules, raw, overrides)
    cpu = cluster.device == "cpu" or (cluster.device == "auto" and not cuda_available())
    _set_defaults(rules, options, cpu, cluster.kv_store)
    switchable = switching.decide(options, cluster, cpu, role)
    traced_env = tracing.apply(options, cluster.tracing, role.value, os.environ if env is None else env)
    ns = options.parse()
    stored = _check_final(rules, ns, cpu, cluster.kv_store)
    advertise = checks.advertise_address(ns.host, cluster.advertise_host)
    kv_bootstrap_port = rules.kv_bootstrap_port(options, ns, cluster)
    if switchable and kv_bootstrap_port is None:  # SGLang runs a KV bootstrap server on every switch-enabled worker
        kv_bootstrap_port = checks.kv_bootstrap_port(options, ns, cluster)
    kv_events = plan_kv_events(options, ns, cluster, advertise, rules.PUBLISHES_KV_EVENTS or switchable,
                               (ns.port, kv_bootstrap_port))
    cores = checks.check_cpus(cluster)
    cpu_env = {**(switching.CPU_ENV if switchable else {}), **rules.CPU_ENV}
    final_env, env_added = environment.sglang_env(cluster, ns, advertise, cores, stored, cpu_env if cpu else None, env)
    final_env.update(traced_env)  # SGLang reads the protocol from this variable only: the setting decides it
    env_added.update(traced_env)
    for key, value in switching.ENV.items() if switchable else ():
        env_added[key] = final_env.setdefault(key, value)
    registration = build_registration(role, cluster, ns, advertise, kv_bootstrap_port, checks.capabilities(ns, cpu))
    registration.kv_events, registration.switch_enabled = kv_events, switchable
    flip = None
    if switchable and kv_bootstrap_port is not None:
        flip = switching.FlipPlan(advertise, kv_bootstrap_port, kv_events)
        registration = switching.registration_as(role, registration, flip)
    return LaunchPlan(role, _command(role, options, stored, cores), final_env, env_added, cluster, registration, cpu,
                      flip)


def _role_options(rules: RoleRules, raw: dict, overrides: list[str]) -> SGLangOptions:
    """The file's SGLang options, the command line's on top, checked against the role, which sets the mode."""
    role = rules.ROLE
    options = SGLangOptions(sglang_parser())
    for key, value in raw.items():
        options.set_value(key, value)
    options.apply_argv(overrides)
    mode = options.tokens.get("disaggregation_mode")
    if mode and mode[1:] != [role.value]:
        raise ConfigError(f"disaggregation-mode {' '.join(mode[1:])} contradicts this {role.value} worker")
    rules.check_options(options)
    options.set_value("disaggregation-mode", role.value)
    return options


def _set_defaults(rules: RoleRules, options: SGLangOptions, cpu: bool, kv: KVStoreSettings | None) -> None:
    """What no source set: the CPU profile, Mooncake, and what kv_store needs."""
    if cpu:
        for key, value in {**CPU_FLAGS, **rules.CPU_FLAGS}.items():
            options.set_default(key, value)
    options.set_default("disaggregation-transfer-backend", "mooncake")  # explicit, whatever SGLang's default
    # OpenAI answers' usage.prompt_tokens_details.cached_tokens (chat and completions, whole and streamed): SGLang
    # leaves it null without this; the decode answers, with the prefill's count.
    options.set_default("enable-cache-report", True)
    if kv is not None:
        options.set_default("page-size", KV_PAGE_SIZE)
        for key, value in rules.kv_store_flags(kv, KV_DEVICE_FLAGS[cpu]).items():
            options.set_default(key, value)
        _wire_sealed_storage(options, kv)


def _check_final(rules: RoleRules, ns: argparse.Namespace, cpu: bool,
                 kv: KVStoreSettings | None) -> KVStoreSettings | None:
    """Refuse final options that cannot work here; return the KV store this worker writes to, if any."""
    stored = kv if kv is not None and rules.stores_kv(ns) else None
    if stored is not None:
        checks.check_kv_store(ns, cpu, rules.check_kv_store)
        checks.check_kv_store_dir(stored.dir)
    if ns.disaggregation_transfer_backend not in MOONCAKE_BACKENDS | rules.EXTRA_TRANSFER_BACKENDS:
        raise ConfigError(f"disaggregation-transfer-backend {ns.disaggregation_transfer_backend}: pdcluster moves KV "
                          f"with Mooncake (mooncake, or mooncake_tcp without RDMA)")
    checks.check_model_path(ns.model_path)
    checks.check_port_free(ns.host, ns.port, "SGLang HTTP")
    return stored


def _command(role: Role, options: SGLangOptions, stored: KVStoreSettings | None, cores: list[int]) -> list[str]:
    """SGLang's command line, inside the kv_store launcher and taskset when they apply."""
    command = [sys.executable, "-m", "sglang.launch_server", *options.argv()]
    # With a KV store: prepares the namespace and builds the page-hash extension, then execs SGLang (kvstore/launch.py)
    if stored is not None:
        command = [sys.executable, "-m", "pdcluster.kvstore", "launch", "--role", role.value,
                   "--dir", os.path.abspath(os.path.expanduser(stored.dir)),
                   "--orphan-tmp-age", str(stored.orphan_tmp_age), "--", *command]
    if cores:  # taskset execs the command on those cores: every process and thread it starts inherits them
        command = [TASKSET, "--cpu-list", ",".join(map(str, cores)), *command]
    return command


def _wire_sealed_storage(options: SGLangOptions, kv: KVStoreSettings) -> None:
    """Where the role stores KV, SGLang loads pdcluster's sealed storage (pdcluster/kvstore/wiring.py), and serves
    /metrics, where that storage's rejections and failed writes are counted."""
    backend = options.tokens.get("hicache_storage_backend", [])[1:]
    if backend != [wiring.BACKEND]:
        return  # the role stores nothing, or the file set another backend: check_kv_store refuses that
    configured = options.tokens.get(wiring.EXTRA_CONFIG, [None, None])[1]
    options.set_value("hicache-storage-backend-extra-config", wiring.extra_config(configured, kv.secret_file))
    options.set_default("enable-metrics", True)
