"""Load-balancing policies, chosen by name in the router config: each picks one worker among the candidates that
router/pairing.py has already filtered (never an empty list, never to be mutated). `Policy` is the interface with
its hooks; REGISTRY names every policy."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

from router.workers import Worker


class Policy:
    name: str = ""
    # Whether choose() reads the prompt. If not, it gets "" and the prompt is never made into text for it.
    needs_prompt: bool = False

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        """`candidates` is never empty; the policy must not mutate it. `prompt`: at most HINT_CHARS of the prompt
        as text, if the policy `needs_prompt`."""
        raise NotImplementedError

    def worker_removed(self, worker_id: str) -> None:
        """The worker left the pool for good: forget what is kept about it."""


class RoundRobin(Policy):
    """Each candidate in turn. The counter is global, so with a changing candidate set the turn still rotates."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        return self._rng.choice(candidates)


class PowerOfTwo(Policy):
    """Sample two candidates, take the one with fewer in-flight requests: near-least-loaded without a global scan."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(list(candidates), 2)
        return first if first.in_flight <= second.in_flight else second


class PrefixAffinity(Policy):
    """Requests sharing a prompt prefix go to the worker that served it, so SGLang's radix cache hits.

    The prompt is cut into blocks; each block's key hashes the whole prefix up to it (like SGLang's page keys), and a
    bounded LRU map remembers which worker last served each key. The longest remembered prefix wins, unless that
    worker has `max_imbalance` more requests in flight than the least loaded one: then load wins.
    """

    name = "prefix"
    needs_prompt = True

    def __init__(self, block_chars: int = 64, min_blocks: int = 2, max_imbalance: int = 4, capacity: int = 200_000):
        self.block_chars, self.min_blocks, self.max_imbalance, self.capacity = (
            block_chars, min_blocks, max_imbalance, capacity)
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._rng = random.Random()

    def _keys(self, prompt: str) -> list[bytes]:
        keys, digest = [], hashlib.blake2b(digest_size=16)
        data = prompt.encode()
        for start in range(0, len(data) - self.block_chars + 1, self.block_chars):
            digest.update(data[start:start + self.block_chars])
            keys.append(digest.copy().digest())
        return keys

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        keys = self._keys(prompt)
        by_id = {w.worker_id: w for w in candidates}
        lowest = min(w.in_flight for w in candidates)
        least = self._rng.choice([w for w in candidates if w.in_flight == lowest])  # spread new prefixes
        chosen = least
        for depth in range(len(keys), self.min_blocks - 1, -1):
            owner = by_id.get(self._owner.get(keys[depth - 1], ""))
            if owner is not None:
                if owner.in_flight - least.in_flight < self.max_imbalance:
                    chosen = owner
                break
        for key in keys:
            self._owner[key] = chosen.worker_id
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return chosen

    def worker_removed(self, worker_id: str) -> None:
        for key in [key for key, owner in self._owner.items() if owner == worker_id]:
            del self._owner[key]


REGISTRY: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    RandomChoice.name: RandomChoice,
    PowerOfTwo.name: PowerOfTwo,
    PrefixAffinity.name: PrefixAffinity,
}


def known_policy(name: str) -> str:
    """`name` if a policy has it (the router config checks its policy names with this), else ValueError."""
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return name


def make_policy(name: str) -> Policy:
    return REGISTRY[known_policy(name)]()
