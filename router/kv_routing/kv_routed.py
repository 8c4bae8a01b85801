"""The prompts this router sent to each prefill lately, counted as held there until that prefill's own KV events can say
so (router/kv_routing/kv_index.py). A prefill publishes a prompt's pages only after computing it, so without this every
request of a burst that shares a new prefix is routed before any of it is heard of, and spread over the prefills by
load: each computes the prefix (measured: cache_aware at 0.91 of the oracle's cached tokens, as round robin, while the
text prefix policy, which knows at once, had 0.95). SGLang's own cache-aware router inserts a prompt into its tree when
it routes it, for the same reason.

A routed prompt is kept as the keys of its leading chunks (router/kv_routing/kv_keys.py's, as the index's: CHUNK tokens
each, a whole number of the engine's pages) for TTL seconds, by then long heard of or never going to be (a failed
request). At most MAX_PROMPTS are kept, the oldest going first. What it claims is a prediction like the index's: wrong,
it costs a cache hit, never an answer.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from router.kv_routing.kv_keys import ROOT, LazyIds, chunk_tokens, key

__all__ = ["RoutedPrompts", "chunk_keys", "chunk_tokens"]

TTL = 20.0  # seconds a routed prompt counts as held
MAX_PROMPTS = 256


def chunk_keys(token_ids: Sequence[int], chunk: int, limit: int) -> list[int]:
    """The keys of the whole chunks in the first `limit` tokens."""
    keys, last = [], ROOT
    for start in range(0, min(limit, len(token_ids)) - chunk + 1, chunk):
        last = key(last, token_ids[start:start + chunk])
        keys.append(last)
    return keys


@dataclass(slots=True, eq=False)
class Routed:
    until: float
    worker_id: str
    chunk: int
    keys: list[int]
    kept: bool = True


class RoutedPrompts:
    def __init__(self, ttl: float = TTL, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.clock = ttl, clock
        self.prompts: deque[Routed] = deque()  # oldest first
        self.keys: dict[tuple[str, int], Counter[int]] = {}  # (worker, chunk) -> key -> prompts kept that have it

    def add(self, worker_id: str, chunk: int, keys: list[int], tidy: bool = True) -> Routed | None:
        """Counts the prompt whose leading chunks' `keys` these are as held by the worker; the entry, to `extend`.
        `tidy`: first forget what expired and the oldest past MAX_PROMPTS, else leave that to a `tidy` later."""
        if not keys:
            return None
        if tidy:
            self.tidy(room=1)
        routed = Routed(self.clock() + self.ttl, worker_id, chunk, list(keys))
        self.prompts.append(routed)
        self.keys.setdefault((worker_id, chunk), Counter()).update(routed.keys)
        return routed

    def extend(self, routed: Routed, keys: list[int]) -> None:
        """The rest of a prompt `add`ed with its first keys (`keys`: all of them), unless forgotten meanwhile."""
        more = keys[len(routed.keys):]
        if routed.kept and more:
            routed.keys += more
            self.keys[(routed.worker_id, routed.chunk)].update(more)

    def tidy(self, room: int = 0) -> None:
        """Forgets what expired, and the oldest past MAX_PROMPTS less `room`: each a prompt's keys to uncount, ~0.1 ms
        for an 8k-token one, which cache_aware spends after its decision, not in it."""
        self._expire()
        while len(self.prompts) > max(0, MAX_PROMPTS - room):
            self._forget(self.prompts.popleft())

    def held(self, worker_ids: Iterable[str], chunk: int, keys: Sequence[int] | LazyIds,
             beyond: dict[str, int] | None = None, expire: bool = True) -> dict[str, int]:
        """Per worker with some: the leading tokens of the prompt whose `keys` these are (or of these ids: read no
        further than a worker was sent) that it was sent lately, if more than its `beyond` (what its events show):
        a key chains all before it, so a worker's walk starts there (at a cached 8k-token prompt: 1 step, not 306).
        `expire`: first forget what expired (else a prompt may count until the next `tidy`)."""
        if expire:
            self._expire()
        found = {}
        for worker_id in worker_ids:
            counts = self.keys.get((worker_id, chunk))
            depth = least = (beyond or {}).get(worker_id, 0) // chunk
            while counts and (at := _key(keys, chunk, depth)) is not None and at in counts:
                depth += 1
            if depth > least:
                found[worker_id] = depth * chunk
        return found

    def drop(self, worker_id: str) -> None:
        """A worker gone (or restarted): nothing it was sent is held."""
        for routed in [r for r in self.prompts if r.worker_id == worker_id]:
            self.prompts.remove(routed)
            routed.kept = False
        for pair in [k for k in self.keys if k[0] == worker_id]:
            del self.keys[pair]

    def _expire(self) -> None:
        now = self.clock()
        while self.prompts and self.prompts[0].until <= now:
            self._forget(self.prompts.popleft())

    def _forget(self, routed: Routed) -> None:
        routed.kept = False
        counts = self.keys.get((routed.worker_id, routed.chunk))
        if counts is None:
            return
        counts.subtract(routed.keys)
        for gone in routed.keys:
            if counts.get(gone, 1) <= 0:
                del counts[gone]
        if not counts:
            del self.keys[(routed.worker_id, routed.chunk)]


def _key(keys: Sequence[int] | LazyIds, chunk: int, i: int) -> int | None:
    if isinstance(keys, LazyIds):
        return keys.chunk_key(chunk, i)
    return keys[i] if i < len(keys) else None
