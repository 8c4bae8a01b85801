"""Which prefill holds which pages of KV, in which tier, from the workers' own KV events (router/kv_wire.py).

Keyed as SGLang's gateway keys its index: by what a page holds, not by the engine's hash, so it never depends on the
engine's hash function or its namespacing. A page's key chains its parent's key with its own token ids (so it says
the page's position and everything before it); the router computes the same chain over a request's token ids and
walks it while some worker holds the next key. The engine's hash is kept only to resolve removals and to find a
stored page's parent. A page is held while any tier (GPU, CPU_PINNED, DISK, EXTERNAL: HiCache's) holds it: HiCache
loads a page held lower back for the next request.

Bounded: at most `max_pages` pages per worker; past that new pages are not indexed (the index then under-claims,
which only costs a hit, never a wrong claim).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from router.kv_wire import Cleared, Event, Removed, Stored

ROOT = 0  # the key a first page chains from
MAX_PAGES_PER_WORKER = 262_144


def page_key(parent_key: int, tokens: Sequence[int]) -> int:
    # CPython hashes tuples of ints the same in every process (no PYTHONHASHSEED), and in C: ~0.1 us a small page.
    return hash((parent_key, tuple(tokens)))


@dataclass(slots=True)
class Page:
    key: int
    media: set[str]


@dataclass
class WorkerIndex:
    max_pages: int = MAX_PAGES_PER_WORKER
    block_size: int | None = None  # a page's tokens: the registered page size, else learnt from its first event
    pages: dict[int, Page] = field(default_factory=dict)  # engine hash -> page
    keys: dict[int, int] = field(default_factory=dict)  # content key -> pages holding it (LoRA namespaces may share)
    orphans: int = 0  # stored pages whose parent it never saw (joined late): not indexed
    heard: bool = False  # an event came since it was opened (a silent publisher's index knows nothing)
    overflow: int = 0  # stored pages past max_pages: not indexed

    def apply(self, event: Event) -> None:
        self.heard = True
        if isinstance(event, Stored):
            self._store(event)
        elif isinstance(event, Removed):
            for block in event.hashes:
                self._remove(block, event.medium)
        elif isinstance(event, Cleared):
            self.clear()

    def _store(self, event: Stored) -> None:
        if event.parent is None:
            parent_key = ROOT
        elif (parent := self.pages.get(event.parent)) is not None:
            parent_key = parent.key
        else:
            self.orphans += len(event.hashes)
            return
        size = event.block_size
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:  # a partial page; else not SGLang (a restart with another size is a new index)
            return
        for i, block in enumerate(event.hashes):
            tokens = event.token_ids[i * size:(i + 1) * size]
            if len(tokens) < size:
                return  # a partial last page: matching walks whole pages only
            known = self.pages.get(block)
            if known is not None:
                known.media.add(event.medium)  # the same page in another tier (HiCache's backup, a load-back)
                parent_key = known.key
                continue
            if len(self.pages) >= self.max_pages:
                self.overflow += len(event.hashes) - i
                return
            parent_key = page_key(parent_key, tokens)
            self.pages[block] = Page(parent_key, {event.medium})
            self.keys[parent_key] = self.keys.get(parent_key, 0) + 1

    def _remove(self, block: int, medium: str) -> None:
        page = self.pages.get(block)
        if page is None:
            return
        page.media.discard(medium)
        if page.media:
            return
        del self.pages[block]
        left = self.keys[page.key] - 1
        if left:
            self.keys[page.key] = left
        else:
            del self.keys[page.key]

    def clear(self) -> None:
        self.pages.clear()
        self.keys.clear()


class KvIndex:
    """Every subscribed worker's index, by worker id. A worker is `live` from its subscription on: the subscriber
    (router/kv_events.py) replays what its publisher buffered first, so a (re)started router starts from it. It is
    `heard` once an event came: routing by the index of a publisher that sent nothing (none yet, or a port the
    router cannot reach) would claim to know what it does not."""

    def __init__(self, max_pages: int = MAX_PAGES_PER_WORKER):
        self.max_pages = max_pages
        self.workers: dict[str, WorkerIndex] = {}

    def open(self, worker_id: str, page_size: int | None) -> WorkerIndex:
        """A fresh, empty index for the worker (a new subscription: a new worker, instance or publisher)."""
        index = self.workers[worker_id] = WorkerIndex(self.max_pages, page_size)
        return index

    def drop(self, worker_id: str) -> None:
        """Nothing is known of the worker any more: its routing is blind until it is subscribed again."""
        self.workers.pop(worker_id, None)

    def live(self, worker_id: str) -> bool:
        return worker_id in self.workers

    def heard(self, worker_id: str) -> bool:
        index = self.workers.get(worker_id)
        return index is not None and index.heard

    def apply(self, worker_id: str, events: Iterable[Event]) -> None:
        index = self.workers.get(worker_id)
        if index is not None:
            for event in events:
                index.apply(event)

    def size(self, worker_id: str) -> int:
        index = self.workers.get(worker_id)
        return len(index.pages) if index is not None else 0

    def match(self, worker_ids: Iterable[str], token_ids: Sequence[int], limit: int | None = None) -> dict[str, int]:
        """Per worker, how many leading tokens of `token_ids` (of its first `limit`) it holds (whole pages). Stops
        hashing at the first page no worker holds: a miss costs one hash."""
        end = len(token_ids) if limit is None else min(limit, len(token_ids))
        held: dict[str, int] = {}
        by_size: dict[int, list[tuple[str, WorkerIndex]]] = {}
        for worker_id in worker_ids:
            index = self.workers.get(worker_id)
            if index is not None and index.block_size:
                by_size.setdefault(index.block_size, []).append((worker_id, index))
        for size, indexes in by_size.items():
            held.update((worker_id, 0) for worker_id, _ in indexes)
            key, depth = ROOT, 0
            while indexes and (depth + 1) * size <= end:
                key = page_key(key, token_ids[depth * size:(depth + 1) * size])
                depth += 1
                indexes = [(worker_id, index) for worker_id, index in indexes if key in index.keys]
                held.update((worker_id, depth * size) for worker_id, _ in indexes)
        return held
