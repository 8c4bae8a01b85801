"""Which prefill holds which pages of KV, in which tier, from the workers' own KV events (router/kv_routing/kv_wire.py).

Keyed as SGLang's gateway keys its index: by what a page holds, not by the engine's hash, so it never depends on the
engine's hash function or its namespacing. A page's key chains the keys of the chunks before it with its own tokens
since (router/kv_routing/kv_keys.py: it says the page's position and everything before it); the router computes the same
keys over a request's token ids and walks them while some worker holds the next chunk. The engine's hash is kept only to
resolve removals and to find a stored page's parent. A page is in a worker's memory while a tier of it (GPU, CPU_PINNED:
HiCache's) holds it: HiCache loads a page held lower back for the next request.

A worker's KV store on disk (pdcluster/kvstore/) has an index of its own, shared by every worker registered with the
same store (`KVStoreMembership.store`: namespace and directory id, so one volume's replicas share it, two disks do
not), and kept when they restart: a restarted prefill's memory is empty, its store's pages are not. SGLang 0.5.23
publishes nothing of its storage tier (its HiCache tree, srt/mem_cache/unified_cache/unified_tree_core.py, sends GPU
and CPU_PINNED only; storage writes and the disk's LRU evictions are silent), but a prefill with a store writes
through: a page in its host memory (CPU_PINNED) is written to the store next, or was read from it. So such a page, or
one of a DISK/EXTERNAL event should SGLang send one, is taken to be on the store until the store index's own LRU bound
drops it. A page the disk lost meanwhile (evicted first, a failed write) is still claimed: a lost hit, which the
prediction metrics show, never a wrong answer.

Bounded: at most `max_pages` pages per worker; past that new pages are not indexed (the index then under-claims,
which only costs a hit, never a wrong claim). A store holds at most `max_pages` too, the least recently stored going
first (no removal comes), and at most MAX_IDLE_STORES stores no subscribed worker uses are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from router.kv_routing.kv_keys import ROOT, Held, LazyIds, Walk, chunk_tokens, key, walk
from router.kv_routing.kv_wire import Cleared, Event, Removed, Stored

MAX_PAGES_PER_WORKER = 262_144
MAX_IDLE_STORES = 4  # stores whose workers are gone (restarting, perhaps), kept
MEMORY = frozenset({"GPU", "CPU_PINNED"})
ON_STORE = frozenset({"CPU_PINNED", "DISK", "EXTERNAL"})  # with a store: on it (written through, or read from it)
# a page's key, its chunk's base key, its tokens since (router/kv_routing/kv_keys.py)
Link = tuple[int, int, tuple[int, ...]]
TOP: Link = (ROOT, ROOT, ())  # what a first page chains from


def _link(parent: Link, tokens: Sequence[int], chunk: int) -> Link:
    tail = parent[2] + tuple(tokens)
    page = key(parent[1], tail)
    return (page, page, ()) if len(tail) == chunk else (page, parent[1], tail)


@dataclass(slots=True)
class Page:  # lean: at page size 1 a worker may hold 262k (a Link's fields, not the tuple; its tiers, shared)
    key: int
    base: int
    tail: tuple[int, ...]
    media: frozenset[str]


_MEDIA: dict[frozenset[str], frozenset[str]] = {}  # each set of tiers, once (a set a page: ~200 bytes)


def _media(media: frozenset[str]) -> frozenset[str]:
    return _MEDIA.setdefault(media, media)


@dataclass
class StoreIndex:
    """The pages on one KV store, whichever worker put them there."""

    name: str
    max_pages: int = MAX_PAGES_PER_WORKER
    block_size: int | None = None
    pages: OrderedDict[int, Link] = field(default_factory=OrderedDict)  # engine hash -> its link, least recent first
    keys: dict[int, int] = field(default_factory=dict)  # content key -> pages holding it
    members: set[str] = field(default_factory=set)  # the subscribed workers registered with it

    def add(self, block: int, link: Link, size: int) -> None:
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            return
        if block in self.pages:
            self.pages.move_to_end(block)  # written or read again: the disk's LRU keeps it too
            return
        if len(self.pages) >= self.max_pages:
            self._unkey(self.pages.popitem(last=False)[1][0])
        self.pages[block] = link
        self.keys[link[0]] = self.keys.get(link[0], 0) + 1

    def remove(self, block: int) -> None:
        link = self.pages.pop(block, None)
        if link is not None:
            self._unkey(link[0])

    def _unkey(self, key: int) -> None:
        left = self.keys[key] - 1
        if left:
            self.keys[key] = left
        else:
            del self.keys[key]


@dataclass
class WorkerIndex:
    max_pages: int = MAX_PAGES_PER_WORKER
    block_size: int | None = None  # a page's tokens: the registered page size, else learnt from its first event
    pages: dict[int, Page] = field(default_factory=dict)  # engine hash -> page in memory
    keys: dict[int, int] = field(default_factory=dict)  # content key -> pages holding it (LoRA namespaces may share)
    orphans: int = 0  # stored pages whose parent it never saw (joined late): not indexed
    heard: bool = False  # an event came since it was opened (a silent publisher's index knows nothing)
    overflow: int = 0  # stored pages past max_pages: not indexed
    store: StoreIndex | None = None  # the KV store it writes through to, if it registered one

    def apply(self, event: Event) -> None:
        self.heard = True
        if isinstance(event, Stored):
            self._store(event)
        elif isinstance(event, Removed):
            for block in event.hashes:
                if self.store is not None and event.medium not in MEMORY:
                    self.store.remove(block)
                else:
                    self._remove(block, event.medium)
        elif isinstance(event, Cleared):
            self.clear()  # its memory: SGLang's flush leaves the storage

    def _parent(self, parent: int) -> Link | None:
        if (page := self.pages.get(parent)) is not None:
            return page.key, page.base, page.tail
        return self.store.pages.get(parent) if self.store is not None else None

    def _store(self, event: Stored) -> None:
        link = TOP if event.parent is None else self._parent(event.parent)
        if link is None:
            self.orphans += len(event.hashes)
            return
        size = event.block_size
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:  # a partial page; else not SGLang (a restart with another size is a new index)
            return
        chunk = chunk_tokens(size)
        store = self.store if event.medium in ON_STORE else None
        in_memory = event.medium in MEMORY or self.store is None  # DISK/EXTERNAL without a store: as held
        for i, block in enumerate(event.hashes):
            tokens = event.token_ids[i * size:(i + 1) * size]
            if len(tokens) < size:
                return  # a partial last page: matching walks whole pages only
            known = self.pages.get(block)
            link = (known.key, known.base, known.tail) if known is not None else _link(link, tokens, chunk)
            if store is not None:
                store.add(block, link, size)
            if not in_memory:
                continue
            if known is not None:
                known.media = _media(known.media | {event.medium})  # another tier too (HiCache: a backup, a load-back)
            elif len(self.pages) >= self.max_pages:
                self.overflow += 1
            else:
                self.pages[block] = Page(*link, _media(frozenset((event.medium,))))
                self.keys[link[0]] = self.keys.get(link[0], 0) + 1

    def _remove(self, block: int, medium: str) -> None:
        page = self.pages.get(block)
        if page is None:
            return
        page.media = _media(page.media - {medium})
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
    """Every subscribed worker's index, by worker id, and every known store's, by name. A worker is `live` from its
    subscription on: the subscriber (router/kv_routing/kv_events.py) replays what its publisher buffered first, so a
    (re)started router starts from it. It is `heard` once an event came: routing by the index of a publisher that sent
    nothing (none yet, or a port the router cannot reach) would claim to know what it does not. A store is known once it
    holds a page, whichever member's events put it there."""

    def __init__(self, max_pages: int = MAX_PAGES_PER_WORKER):
        self.max_pages = max_pages
        self.workers: dict[str, WorkerIndex] = {}
        self.stores: dict[str, StoreIndex] = {}  # the idle ones (no member) last, longest idle first

    def open(self, worker_id: str, page_size: int | None, store: str | None = None) -> WorkerIndex:
        """A fresh, empty index for the worker (a new subscription: a new worker, instance or publisher), writing
        through to `store` (its registered one's name) if any: what the store holds is kept."""
        self._leave(worker_id)
        shared = None
        if store is not None:
            shared = self.stores.get(store)
            if shared is None:
                shared = self.stores[store] = StoreIndex(store, self.max_pages)
            shared.members.add(worker_id)
        index = self.workers[worker_id] = WorkerIndex(self.max_pages, page_size, store=shared)
        return index

    def drop(self, worker_id: str) -> None:
        """Nothing is known of the worker's memory any more: its routing is blind until it is subscribed again (but
        for its store's pages)."""
        self._leave(worker_id)
        self.workers.pop(worker_id, None)

    def _leave(self, worker_id: str) -> None:
        index = self.workers.get(worker_id)
        store = index.store if index is not None else None
        if store is None:
            return
        store.members.discard(worker_id)
        if not store.members:
            self.stores[store.name] = self.stores.pop(store.name)  # the most recently idle, last
            idle = [name for name, s in self.stores.items() if not s.members]
            for name in idle[:max(0, len(idle) - MAX_IDLE_STORES)]:
                del self.stores[name]

    def live(self, worker_id: str) -> bool:
        return worker_id in self.workers

    def heard(self, worker_id: str) -> bool:
        index = self.workers.get(worker_id)
        return index is not None and index.heard

    def known(self, worker_id: str, store: str | None) -> bool:
        """Whether the index knows anything of what the worker holds: its events, or its store's pages."""
        return self.heard(worker_id) or (store is not None and store in self.stores and bool(self.stores[store].pages))

    def apply(self, worker_id: str, events: Iterable[Event]) -> None:
        index = self.workers.get(worker_id)
        if index is not None:
            for event in events:
                index.apply(event)

    def size(self, worker_id: str) -> int:
        index = self.workers.get(worker_id)
        return len(index.pages) if index is not None else 0

    def match(self, worker_ids: Iterable[str], token_ids: Sequence[int], limit: int | None = None) -> dict[str, int]:
        """Per worker, how many leading tokens of `token_ids` (of its first `limit`) it holds in memory."""
        return {worker_id: held.memory for worker_id, held in
                self.held([(worker_id, None) for worker_id in worker_ids], token_ids, limit).items()}

    def held(self, workers: Iterable[tuple[str, str | None]], token_ids: Sequence[int] | LazyIds,
             limit: int | None = None) -> dict[str, Held]:
        """Per (worker, its store's name or None), what it holds of the leading tokens of `token_ids` (of its first
        `limit`; whole pages), as SGLang would find them: the prefix in its memory, then the pages after it that are
        on its store. Stops at the first chunk no worker holds (reading a LazyIds no further than its end)."""
        ids = token_ids if isinstance(token_ids, LazyIds) else LazyIds(token_ids[:limit])
        found: dict[str, Held] = {}
        by_size: dict[int, list[Walk]] = {}
        for worker_id, name in workers:
            index = self.workers.get(worker_id)
            store = self.stores.get(name) if name is not None else None
            size = (index.block_size if index is not None else None) or (store.block_size if store else None)
            if size:
                memory = index.keys if index is not None else {}
                stored = store.keys if store is not None and store.block_size == size else {}
                by_size.setdefault(size, []).append((memory, stored, found.setdefault(worker_id, Held())))
        for size, walks in by_size.items():
            walk(ids, size, walks)
        return found
