"""The prompts this router sent to each prefill lately, counted as held there until that prefill's own KV events can
say so (router/kv_index.py). A prefill publishes a prompt's pages only after computing it, so without this every
request of a burst that shares a new prefix is routed before any of it is heard of, and spread over the prefills by
load: each computes the prefix (measured: cache_aware at 0.91 of the oracle's cached tokens, as round robin, while
the text prefix policy, which knows at once, had 0.95). SGLang's own cache-aware router inserts a prompt into its
tree when it routes it, for the same reason.

A routed prompt is kept as the keys of its leading chunks (CHUNK tokens each, a whole number of the engine's pages;
each key chains all before it, as the index's do) for TTL seconds, by then long heard of or never going to be (a
failed request). At most MAX_PROMPTS are kept, the oldest going first. What it claims is a prediction like the
index's: wrong, it costs a cache hit, never an answer.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

CHUNK = 16  # tokens per key, at least: coarser than a page of 1, so a long prompt's keys stay cheap to make
TTL = 20.0  # seconds a routed prompt counts as held
MAX_PROMPTS = 256


def chunk_tokens(page_size: int) -> int:
    """CHUNK rounded up to a whole number of pages."""
    return -(-CHUNK // page_size) * page_size


def chunk_keys(token_ids: Sequence[int], chunk: int, limit: int) -> list[int]:
    """The keys of the whole chunks in the first `limit` tokens."""
    keys, key = [], 0
    for start in range(0, min(limit, len(token_ids)) - chunk + 1, chunk):
        key = hash((key, tuple(token_ids[start:start + chunk])))
        keys.append(key)
    return keys


class RoutedPrompts:
    def __init__(self, ttl: float = TTL, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.clock = ttl, clock
        self.prompts: deque[tuple[float, str, int, list[int]]] = deque()  # (until, worker, chunk, keys), oldest first
        self.keys: dict[tuple[str, int], Counter[int]] = {}  # (worker, chunk) -> key -> prompts kept that have it

    def add(self, worker_id: str, chunk: int, keys: list[int]) -> None:
        if not keys:
            return
        self._expire()
        if len(self.prompts) >= MAX_PROMPTS:
            self._forget(self.prompts.popleft())
        self.prompts.append((self.clock() + self.ttl, worker_id, chunk, keys))
        self.keys.setdefault((worker_id, chunk), Counter()).update(keys)

    def held(self, worker_ids: Iterable[str], chunk: int, keys: list[int]) -> dict[str, int]:
        """Per worker with some: the leading tokens of the prompt whose `keys` these are that it was sent lately."""
        self._expire()
        found = {}
        for worker_id in worker_ids:
            counts = self.keys.get((worker_id, chunk))
            depth = 0
            while counts and depth < len(keys) and keys[depth] in counts:
                depth += 1
            if depth:
                found[worker_id] = depth * chunk
        return found

    def drop(self, worker_id: str) -> None:
        """A worker gone (or restarted): nothing it was sent is held."""
        for prompt in [p for p in self.prompts if p[1] == worker_id]:
            self.prompts.remove(prompt)
        for key in [k for k in self.keys if k[0] == worker_id]:
            del self.keys[key]

    def _expire(self) -> None:
        now = self.clock()
        while self.prompts and self.prompts[0][0] <= now:
            self._forget(self.prompts.popleft())

    def _forget(self, prompt: tuple[float, str, int, list[int]]) -> None:
        counts = self.keys.get((prompt[1], prompt[2]))
        if counts is None:
            return
        counts.subtract(prompt[3])
        for key in prompt[3]:
            if counts.get(key, 1) <= 0:
                del counts[key]
        if not counts:
            del self.keys[(prompt[1], prompt[2])]
