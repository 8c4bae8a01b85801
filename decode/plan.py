"""What only a decode decides about its SGLang launch; the shared launcher (pdcluster/worker/plan.py) applies it.

A decode receives a prompt's KV from a prefill and generates the answer. It runs no KV bootstrap server: the router
tells it, per request, which prefill's to ask. With `kv_store` and `decode_offload` it also writes the KV of the
tokens it generates to the prefill's store, so that a conversation's next turn finds the answer's pages there too.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdcluster.common.config_file import ConfigError
from pdcluster.common.protocol import Role
from pdcluster.worker import switching
from pdcluster.worker.options import SGLangOptions
from pdcluster.worker.settings import ClusterSettings, KVStoreSettings

ROLE = Role.DECODE

# The decode's part of the CPU profile (the rest is in pdcluster/worker/plan.py).
CPU_FLAGS = {"disaggregation-decode-retraction-backup": "cpu_tensor"}  # else "Torch not compiled with CUDA"
CPU_ENV: dict[str, str] = {}

# Besides Mooncake, SGLang's `fake` transfer backend: the decode makes its KV up instead of receiving it (a decode
# tested without a prefill).
EXTRA_TRANSFER_BACKENDS = frozenset({"fake"})

# A decode runs no radix cache in PD (unless --disaggregation-decode-enable-radix-cache): no KV events.
PUBLISHES_KV_EVENTS = False

# kv_store with decode_offload: write the KV the decode generates into the file storage. That needs the storage
# backend, not enable-hierarchical-cache.
KV_STORE_FLAGS = {
    "disaggregation-decode-enable-offload-kvcache": True,
    "hicache-storage-backend": "dynamic",  # pdcluster's sealed file storage (pdcluster/kvstore/wiring.py)
}


def check_options(options: SGLangOptions) -> None:
    switching.check_decode_port(options)


def kv_store_flags(kv: KVStoreSettings, device_flags: dict[str, Any]) -> dict[str, Any]:
    # Without decode_offload a decode stores nothing: it only uses the prefill's page size (set by the launcher).
    return {**KV_STORE_FLAGS, **device_flags} if kv.decode_offload else {}


def stores_kv(ns: argparse.Namespace) -> bool:
    # Offloading what it generates (decode_offload, or the SGLang option set by hand), or HiCache turned on by hand.
    return ns.disaggregation_decode_enable_offload_kvcache or ns.enable_hierarchical_cache


def check_kv_store(ns: argparse.Namespace) -> None:
    if ns.disaggregation_decode_retraction_backup == "host_pool":
        raise ConfigError("disaggregation-decode-retraction-backup host_pool cannot run with the decode's KV offload "
                          "(kv_store.decode_offload): use cpu_tensor, or set decode_offload: false")


def kv_bootstrap_port(options: SGLangOptions, ns: argparse.Namespace, cluster: ClusterSettings) -> None:
    return None  # a decode runs no KV bootstrap server
