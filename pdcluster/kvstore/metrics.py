"""The KV store's counters, on the worker's own /metrics (SGLang's, with `--enable-metrics`).

The store runs in SGLang's scheduler process, whose metrics reach the HTTP server's /metrics through prometheus_client's
multiprocess mode (files under PROMETHEUS_MULTIPROC_DIR, which SGLang sets before it starts its schedulers). Without
that directory nothing would show them, so the counters are then kept in this process only (unit tests read them).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter

_lock = threading.Lock()
_counters: dict[str, Any] | None = None


def counters() -> dict[str, Any]:
    """One set per process (prometheus_client refuses a name twice in a registry)."""
    global _counters
    with _lock:
        if _counters is None:
            registry = None if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else CollectorRegistry()
            kwargs: dict[str, Any] = {"registry": registry} if registry is not None else {}
            _counters = {
                "rejected": Counter("pdcluster_kv_store_pages_rejected", "Stored KV pages that failed verification "
                                    "when read (a miss: recomputed, the file removed), by reason", ["reason"],
                                    **kwargs),
                "write_failed": Counter("pdcluster_kv_store_write_failures", "KV pages that could not be stored (the "
                                        "request is unaffected), by reason: an errno name, or bound", ["reason"],
                                        **kwargs),
                "read_pages": Counter("pdcluster_kv_store_read_pages", "KV pages read and verified", **kwargs),
                "read_seconds": Counter("pdcluster_kv_store_read_seconds", "Time reading and verifying KV pages",
                                        **kwargs),
                "verify_seconds": Counter("pdcluster_kv_store_verify_seconds", "Of read_seconds, time computing "
                                          "digests", **kwargs),
                "write_pages": Counter("pdcluster_kv_store_write_pages", "KV pages written", **kwargs),
                "write_seconds": Counter("pdcluster_kv_store_write_seconds", "Time sealing and writing KV pages",
                                         **kwargs),
            }
        return _counters
