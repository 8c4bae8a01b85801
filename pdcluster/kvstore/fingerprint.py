"""The fingerprint of a KV namespace: a short hash of everything that decides the bytes of a stored page.

That is the weights' content (never their folder's name or place), the dtypes, the page size, the host layout (the
byte order of a page in its file), the TP/PP split, the served model name (part of SGLang's file names), the device and
SGLang's version. Reading a whole model at every start would take minutes, so a weight file is known by its size and
samples of its bytes, and that digest is remembered by path, size and mtime in a small JSON file.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 1 << 20  # the first, middle and last MiB of every weight file
TENSOR_SAMPLE_BYTES = 4096  # and of a safetensors file, 4 KiB from the middle of every tensor
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
FINGERPRINT_HEX_DIGITS = 16
# SGLang options that change what a page holds, recorded as the parser typed them.
KV_OPTIONS = ("dtype", "kv_cache_dtype", "quantization", "load_format", "json_model_override_args", "page_size",
              "tp_size", "pp_size")


def file_digest(path: Path) -> str:
    """SHA-256 of a weight file's size and samples of its bytes. The per-tensor samples of safetensors files catch a
    fine-tune that rewrote only some tensors (it rewrites each of those whole), wherever they sit in the file."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as handle:
        ranges = [(0, size)] if size <= 3 * SAMPLE_BYTES else [
            (0, SAMPLE_BYTES), (size // 2 - SAMPLE_BYTES // 2, SAMPLE_BYTES), (size - SAMPLE_BYTES, SAMPLE_BYTES)]
        if path.suffix == ".safetensors" and size > 3 * SAMPLE_BYTES:
            ranges += _tensor_samples(handle, size)
        for offset, length in ranges:
            handle.seek(offset)
            digest.update(handle.read(length))
    return digest.hexdigest()


def _tensor_samples(handle: Any, size: int) -> list[tuple[int, int]]:
    try:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len)) if 0 < header_len <= size - 8 else {}
    except ValueError:
        return []  # not a safetensors file after all: the three samples still apply
    base, ranges = 8 + header_len, [(0, 8 + header_len)]
    for name, meta in sorted(header.items()):
        if name != "__metadata__" and isinstance(meta, dict) and len(meta.get("data_offsets", ())) == 2:
            start, end = meta["data_offsets"]
            length = min(TENSOR_SAMPLE_BYTES, end - start)
            ranges.append((base + (start + end - length) // 2, length))
    return ranges


class DigestCache:
    """Weight-file digests by resolved path, size and mtime, in a JSON file (None: remember nothing)."""

    def __init__(self, path: Path | None):
        self.path = path
        try:
            self.entries: dict[str, dict] = json.loads(path.read_text()) if path else {}
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def digest(self, file: Path) -> str:
        stat = file.stat()
        key = str(file.resolve())
        entry = self.entries.get(key)
        if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
            return entry["digest"]
        value = file_digest(file)
        self.entries[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "digest": value}
        self.changed = True
        return value

    def save(self) -> None:
        if not self.path or not self.changed:
            return
        live = {key: entry for key, entry in self.entries.items() if os.path.exists(key)}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.new")
        try:
            tmp.write_text(json.dumps(live, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # replicas starting together: the last writer wins, nothing is half-written
        except OSError:
            pass  # only a speed-up: the next start reads the samples again


def weights_identity(model_dir: Path, cache: DigestCache) -> dict[str, Any]:
    """config.json's hash and every weight file's digest, by its path inside the model folder."""
    config = model_dir / "config.json"
    files = sorted(p for p in model_dir.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(model_dir).parts))
    identity = {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "files": {p.relative_to(model_dir).as_posix(): cache.digest(p) for p in files},
    }
    cache.save()
    return identity


def effective_layout(layout: str, io_backend: str) -> str:
    """The host layout SGLang really uses (its hicache_hook: page_first with the direct io backend becomes
    page_first_direct), which is the byte order of a page in its file."""
    return "page_first_direct" if layout == "page_first" and io_backend == "direct" else layout


def kv_identity(ns: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """Everything that decides a page's bytes, from SGLang's parsed options and the weights' identity."""
    identity: dict[str, Any] = {option: _plain(getattr(ns, option, None)) for option in KV_OPTIONS}
    identity["page_size"] = ns.page_size or 1
    identity.update(
        weights=weights,
        served_model_name=ns.served_model_name or ns.model_path,
        layout=effective_layout(ns.hicache_mem_layout, ns.hicache_io_backend),
        device=ns.device or "cuda",
        sglang=_sglang_version(),
    )
    return identity


def fingerprint(identity: dict[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_HEX_DIGITS]


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value, sort_keys=True)


def _sglang_version() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"
