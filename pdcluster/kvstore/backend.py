"""SGLang HiCache storage backend: SGLang's file storage, with every page sealed when written and checked when read.

Loaded by SGLang's own backend factory (`--hicache-storage-backend dynamic`, the class named in
`--hicache-storage-backend-extra-config`), so it runs the same on GPU and CPU and patches nothing. It subclasses
SGLang's HiCacheFile: file names, the LRU evictor (`SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE`), existence queries and the
namespace directory stay SGLang's; only a page's bytes on disk gain a trailer (page_seal.py).

A page that fails its check is a miss: SGLang's prefetch then uses the pages before it and recomputes the rest. The
file is removed (unless another writer replaced it meanwhile), so a damaged page costs one recomputation, not one per
request; each read batch with rejections logs one line, and every rejection counts in
`pdcluster_kv_store_pages_rejected_total{reason}`. A write that fails (disk full, read-only, directory gone) returns
False as SGLang's does: the request never waits for it, and it counts in `pdcluster_kv_store_write_failures_total`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections import Counter
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from pdcluster.kvstore import metrics
from pdcluster.kvstore.page_seal import TRAILER_SIZE, PageSeal, load_secret

logger = logging.getLogger(__name__)


class SealedFileStorage(HiCacheFile):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        super().__init__(storage_config)
        extra = storage_config.extra_config or {}
        secret = load_secret(extra.get("secret_file"))
        self.seal = PageSeal(os.path.basename(os.path.normpath(self.file_path)), secret)
        self.metrics = metrics.counters()
        logger.info("pdcluster KV store in %s: pages sealed (keyed BLAKE3), %s", self.file_path,
                    "keyed with the cluster secret" if secret else "no cluster secret (integrity only)")

    # -- reads
    def get(self, key: str, target_location: torch.Tensor, target_sizes: Any = None) -> torch.Tensor | None:
        rejected: Counter[str] = Counter()
        page = self._read(key, target_location, rejected)
        self._log_rejections(rejected)
        return page

    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor],
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        # Every page of the batch is checked, even past a bad one, so that all damaged pages go at once: SGLang skips
        # writing a page whose file exists, so a damaged page left behind would cost a recomputation every time.
        rejected: Counter[str] = Counter()
        pages = [self._read(key, target, rejected) for key, target in zip(keys, target_locations, strict=True)]
        self._log_rejections(rejected)
        return pages

    def _read(self, key: str, target: torch.Tensor, rejected: Counter[str]) -> torch.Tensor | None:
        stem = self._get_suffixed_key(key)
        path = os.path.join(self.file_path, f"{stem}.bin")
        started = time.perf_counter()
        buf = target.view(torch.uint8).contiguous().numpy().data
        try:
            with open(path, "rb", buffering=0) as handle:
                identity = os.fstat(handle.fileno())
                reason = "size" if identity.st_size != len(buf) + TRAILER_SIZE else None
                if reason is None:  # the size matched at open; a writer cutting it since shows as a short read
                    trailer = handle.read(TRAILER_SIZE) if _read_exact(handle, buf) else b""
                    verify_started = time.perf_counter()
                    reason = self.seal.check(stem, buf, trailer)
                    self.metrics["verify_seconds"].inc(time.perf_counter() - verify_started)
        except FileNotFoundError:  # evicted or removed since the existence query: a plain miss
            if self.metadata_cache is not None:
                self.metadata_cache.remove(stem)
            return None
        except OSError as exc:
            logger.warning("KV store: cannot read page %s: %s", stem, exc)
            reason, identity = "io", None
        if reason is not None:
            self._reject(stem, path, identity, reason)
            rejected[reason] += 1
            return None
        self._evictor.touch(stem, path)
        if self.metadata_cache is not None:
            self.metadata_cache.add(stem)
        self.metrics["read_pages"].inc()
        self.metrics["read_seconds"].inc(time.perf_counter() - started)
        return target

    def _reject(self, stem: str, path: str, identity: os.stat_result | None, reason: str) -> None:
        self.metrics["rejected"].labels(reason=reason).inc()
        try:
            now = os.stat(path)
            # Only the file that was read: another replica may have written a good page under that name since.
            if identity is None or (now.st_ino, now.st_dev) == (identity.st_ino, identity.st_dev):
                os.unlink(path)
        except OSError:
            pass  # gone already, or a read-only store: still a miss, checked again next time
        self._evictor.abort(stem)  # out of the LRU index, its bytes refunded
        if self.metadata_cache is not None:
            self.metadata_cache.remove(stem)

    def _log_rejections(self, rejected: Counter[str]) -> None:
        if rejected:
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(rejected.items()))
            logger.warning("KV store %s: %d stored page(s) failed verification (%s): removed, recomputed instead",
                           self.file_path, sum(rejected.values()), reasons)

    # -- writes
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        stem = self._get_suffixed_key(key)
        path = os.path.join(self.file_path, f"{stem}.bin")
        if self.exists(key):  # as SGLang's: the page is there already
            self._evictor.touch(stem, path)
            return True
        started = time.perf_counter()
        page = value.contiguous().view(dtype=torch.uint8).numpy().data
        trailer = self.seal.trailer(stem, page)
        if not self._evictor.reserve(stem, len(page) + TRAILER_SIZE, key=key):
            self.metrics["write_failed"].labels(reason="bound").inc()
            return False
        tmp = os.path.join(self.file_path, f".{uuid.uuid4().hex}.tmp")  # SGLang's name: orphan clean-up knows it
        try:
            with open(tmp, "wb", buffering=0) as handle:
                _write_all(handle, page)
                _write_all(handle, trailer)
            os.replace(tmp, path)  # readers see a whole file or none (a torn one fails its check anyway)
        except OSError as exc:
            logger.error(f"Failed to save tensor {key}: {exc}")  # SGLang's wording: docs and operators grep for it
            self.metrics["write_failed"].labels(reason=errno.errorcode.get(exc.errno or 0, "error")).inc()
            self._evictor.abort(stem)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if self.metadata_cache is not None:
                self.metadata_cache.remove(stem)
            return False
        self._evictor.commit(stem)
        if self.metadata_cache is not None:
            self.metadata_cache.add(stem)
        self.metrics["write_pages"].inc()
        self.metrics["write_seconds"].inc(time.perf_counter() - started)
        return True


def _read_exact(handle: Any, buf: memoryview) -> bool:
    done = 0
    while done < len(buf):
        got = handle.readinto(buf[done:])
        if not got:
            return False
        done += got
    return True


def _write_all(handle: Any, data: memoryview | bytes) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        written = handle.write(view[done:])
        if not written:  # a raw write that stores nothing without an error: treat as a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += written
