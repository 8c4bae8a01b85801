"""`python -m pdcluster.kvstore verify`: check the seal of every stored page, as a worker would when reading it.

A namespace's pages all have one size (the model's page); the most common size among its files is taken as that, so a
page cut short or grown is found even when its tail happens to look like a seal. Without `--remove` nothing changes:
each bad page is listed with what would be done. With it, each is removed unless it changed since it was checked
(another worker may have replaced it with a good one), as a worker would remove it at its next read.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.kvstore.page_seal import TRAILER_SIZE, PageSeal


@dataclass
class Verdict:
    namespace: Path
    checked: int = 0
    bad: list[tuple[Path, str, bool]] = field(default_factory=list)  # (file, reason, removed)

    @property
    def removed(self) -> int:
        return sum(1 for *_, gone in self.bad if gone)

    def reasons(self) -> dict[str, int]:
        return dict(sorted(Counter(reason for _, reason, _ in self.bad).items()))


def verify_namespace(path: Path, secret: bytes | None, remove: bool) -> Verdict:
    seal = PageSeal(path.name, secret)
    files = sorted(entry for entry in path.iterdir() if entry.name.endswith(".bin") and entry.is_file())
    sizes = Counter(_size(f) for f in files)
    sizes.pop(-1, None)
    page_bytes = sizes.most_common(1)[0][0] - TRAILER_SIZE if sizes else None
    verdict = Verdict(path)
    for f in files:
        before = _stat(f)
        reason = seal.check_file(f, page_bytes)
        if before is None:
            continue  # evicted meanwhile
        verdict.checked += 1
        if reason is None:
            continue
        gone = False
        if remove and _stat(f) == before:
            try:
                os.unlink(f)
                gone = True
            except OSError:
                pass  # read-only, or removed by a worker meanwhile: still listed
        verdict.bad.append((f, reason, gone))
    return verdict


def _stat(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns


def _size(path: Path) -> int:
    stat = _stat(path)
    return -1 if stat is None else stat[2]
