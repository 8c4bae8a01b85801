"""What only a prefill decides about its SGLang launch; the shared launcher (pdcluster/worker/plan.py) applies it.

A prefill computes a prompt's KV and writes it into a decode's memory over Mooncake. It runs SGLang's KV bootstrap
server, which the decode asks where to fetch from. With `kv_store` it is the worker that keeps prompts' KV on disk and
serves them from there again.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdcluster.common.config_file import ConfigError
from pdcluster.common.protocol import Role
from pdcluster.kvstore import wiring
from pdcluster.worker import checks
from pdcluster.worker.options import SGLangOptions
from pdcluster.worker.settings import ClusterSettings, KVStoreSettings

ROLE = Role.PREFILL

# The prefill's part of the CPU profile (the rest is in pdcluster/worker/plan.py).
CPU_FLAGS = {"disable-overlap-schedule": True}  # else "dummy base class Event" on a prefix-cache hit
CPU_ENV = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}

# Mooncake only: a prefill must send real KV.
EXTRA_TRANSFER_BACKENDS: frozenset[str] = frozenset()

# Its radix cache's KV events, for the routers' cache_aware policy (pdcluster/worker/kv_events.py).
PUBLISHES_KV_EVENTS = True

# kv_store: SGLang's HiCache with its file storage, so that what a prefill computes is written to disk and read back.
KV_STORE_FLAGS = {
    "enable-hierarchical-cache": True,
    "hicache-storage-backend": "dynamic",  # pdcluster's sealed file storage (pdcluster/kvstore/wiring.py)
    "hicache-write-policy": "write_through",  # write_back never writes a prompt's first pages (sglang #26886)
}


def check_options(options: SGLangOptions) -> None:
    backend = options.tokens.get("disaggregation_transfer_backend")
    if backend and backend[1:] == ["fake"]:
        raise ConfigError("disaggregation-transfer-backend fake is decode-only: a prefill must send real KV")


def kv_store_flags(kv: KVStoreSettings, device_flags: dict[str, Any]) -> dict[str, Any]:
    # prefetch_threshold: stored pages are fetched from this many matching tokens on (SGLang's default, 256, misses
    # the short next turn of a conversation).
    extra: dict[str, Any] = {"prefetch_threshold": kv.prefetch_threshold}
    if device_flags.get("hicache-storage-prefetch-policy") == "timeout":
        extra.update(wiring.PREFETCH_BUDGET)  # how long a request waits for its stored pages
    return {**KV_STORE_FLAGS, **device_flags, "hicache-storage-backend-extra-config": extra}


def stores_kv(ns: argparse.Namespace) -> bool:
    return True  # with kv_store on, a prefill always writes and reads it


def check_kv_store(ns: argparse.Namespace) -> None:
    if not ns.enable_hierarchical_cache:
        raise ConfigError("enable-hierarchical-cache false: a prefill's kv_store needs SGLang's HiCache")
    if ns.hicache_write_policy == "write_back":
        raise ConfigError("hicache-write-policy write_back leaves a prompt's first pages unwritten in the file "
                          "storage (sglang #26886): use write_through with kv_store")


def kv_bootstrap_port(options: SGLangOptions, ns: argparse.Namespace, cluster: ClusterSettings) -> int:
    """The port of this prefill's SGLang KV bootstrap server (pdcluster/worker/checks.py: `kv_bootstrap_port`)."""
    return checks.kv_bootstrap_port(options, ns, cluster)
