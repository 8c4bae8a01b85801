"""One namespace directory, `<dir>/<fingerprint>/`: its record, who uses it, its cleanup, listing and clearing.

Every worker using a namespace holds a shared flock on its `.lock` file for as long as SGLang runs (the launcher
passes the descriptor on across exec). So a starting worker that gets the lock exclusively knows no other worker writes
there and removes every orphan temp file; otherwise it removes only those older than `orphan_tmp_age`, never another
replica's write in flight. `clear` takes the lock exclusively too, so it never deletes under a running worker.

Its `store-id` names the directory itself: made once by its first worker, read by every later one, so replicas that
mount one volume register one id, two disks holding the same namespace two (the routers credit a stored page to the
prefills of its store only). `clear` deletes it with the pages.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD = "namespace.json"
LOCK = ".lock"
STORE_ID = "store-id"
DIGEST_CACHE = ".weights-cache.json"  # in the base directory, shared by its namespaces
ORPHAN_TMP = re.compile(r"^\.[0-9a-f]{32}\.tmp$")  # HiCacheFile's temporary name, f".{uuid4().hex}.tmp"
FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")
STORE_ID_FORMAT = re.compile(r"^[0-9a-f]{32}$")


def open_namespace(base: Path, fp: str, identity: dict[str, Any], model_path: str, orphan_tmp_age: float,
                   now: float | None = None) -> tuple[Path, int, int]:
    """Create or reuse a namespace; returns (its path, a descriptor holding its shared lock, orphans removed)."""
    path = base / fp
    while True:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)
            alone = False
        if _same_file(fd, path / LOCK):
            break
        os.close(fd)  # `clear` deleted the namespace while we waited: start over on the new one
    now = time.time() if now is None else now
    removed = remove_orphans(path, 0.0 if alone else orphan_tmp_age, now)
    write_record(path, fp, identity, model_path, now)
    if alone:
        fcntl.flock(fd, fcntl.LOCK_SH)  # from now on, other replicas may join
    return path, fd, removed


def store_id(path: Path) -> str | None:
    """The namespace directory's id, made if it has none: written whole under a temporary name, then linked, which
    fails if another replica linked its own first (atomic on local file systems and NFS alike): all read the first.
    None if the file holds something else or cannot be made (no shared credit rather than a wrong one)."""
    target = path / STORE_ID
    try:
        if not target.exists():
            tmp = path / f"{STORE_ID}.{uuid.uuid4().hex}.new"
            tmp.write_text(uuid.uuid4().hex + "\n")
            try:
                os.link(tmp, target)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        found = target.read_text().strip()
    except OSError:  # a full, read-only or failing disk costs the shared credit, never the worker's start
        return None
    return found if STORE_ID_FORMAT.match(found) else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def remove_orphans(path: Path, min_age: float, now: float) -> int:
    removed = 0
    for entry in os.scandir(path):
        if ORPHAN_TMP.match(entry.name):
            try:
                if now - entry.stat().st_mtime >= min_age:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass  # its writer finished (renamed it) meanwhile
    return removed


def write_record(path: Path, fp: str, identity: dict[str, Any], model_path: str, now: float) -> None:
    record = read_record(path) or {}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    record = {"fingerprint": fp, "created": record.get("created", stamp), "last_used": stamp,
              "model_path": model_path, "identity": identity}
    tmp = path / f"{RECORD}.{os.getpid()}.new"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path / RECORD)


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclass
class NamespaceInfo:
    fingerprint: str
    path: Path
    record: dict[str, Any]
    files: int
    bytes: int
    last_used: float
    in_use: bool


def scan(base: Path) -> list[NamespaceInfo]:
    found = []
    for entry in sorted(os.scandir(base), key=lambda e: e.name) if base.is_dir() else []:
        record = read_record(Path(entry.path)) if entry.is_dir() else None
        if record is None:
            continue
        files = size = 0
        last = os.stat(Path(entry.path) / RECORD).st_mtime
        for item in os.scandir(entry.path):
            if item.name.endswith(".bin") and item.is_file():
                stat = item.stat()
                files, size, last = files + 1, size + stat.st_size, max(last, stat.st_mtime)
        found.append(NamespaceInfo(entry.name, Path(entry.path), record, files, size, last, in_use(Path(entry.path))))
    return found


def in_use(path: Path) -> bool:
    try:
        fd = os.open(path / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove(path: Path) -> bool:
    """Delete a namespace unless a worker uses it; False when one does."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        shutil.rmtree(path)  # a worker waiting for the lock then finds its file gone and starts over (_same_file)
    finally:
        os.close(fd)
    return True
