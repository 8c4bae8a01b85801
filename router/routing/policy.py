"""What a routing policy reads, what it returns, and the policies that need no more: the contract between pairing
(router/pd/pairing.py), which filters each role's candidates and calls the policies, and the policies, as SGLang's
gateway policies see a read-only `SelectWorkerInfo`. Below both pairing and the cache_aware policy
(router/kv_routing/cache_aware.py), so that each imports it and neither the other.

A policy is given the candidates the filters left (never an empty list, never to be mutated) and a `RoutingView` of
the request: its route, its body, its checks, the prompt as text (`text`, made only when a policy reads it) or as
token ids (`prompt_ids`, if the prefill policy's `prepare` got them). It writes nothing into the request: it returns
its pick, and as the prefill policy the pair's `Choice` (with what it expects the prefill to hold and compute), which
the attempt is given (router/pd/attempt.py). Every policy by its name: router/pd/policies.py.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.checks.checked import Checked
from router.fleet.workers import Worker


@dataclass(frozen=True, slots=True)
class RoutingView:
    """What a policy may read of a request, read-only. `body`: the request's own (a chat's messages, tools and
    template switches, for its token ids); `prompt_ids`: the prompt's leading ids by a worker's tokenizer, if
    `prepare` asked one (router/kv_routing/prompt_ids.py)."""

    route: str
    body: Mapping[str, Any]
    checked: Checked
    prompt_ids: list[int] | None = None
    _text: str | None = field(default=None, init=False, repr=False, compare=False)  # `text`, once made

    @property
    def text(self) -> str:
        """At most HINT_CHARS of the prompt as text (router/checks/checked.py), made once, when a policy reads it: a
        prompt that is not text costs a serialization."""
        text = self._text
        if text is None:
            text = self.checked.hint
            object.__setattr__(self, "_text", text)  # a cache of what the view holds: frozen to the policies
        return text


@dataclass(frozen=True, slots=True)
class Choice:
    """The pair an attempt is sent to, and what the prefill policy expects there: the prompt's tokens it predicted
    the prefill holds (compared with the answer's `cached_tokens`; None: no prediction) and the tokens the prefill
    will compute (booked on its queue; None: the router's estimate, `Checked.prompt_tokens`)."""

    prefill: Worker
    decode: Worker
    predicted_cached: int | None = None
    prefill_work: int | None = None


class Policy:
    """A picker: one worker of the candidates, for the role it was configured for."""

    name: str = ""
    # Awaited once per request, before its first choice, with the available prefills, if set: the prompt's token ids
    # the policy will read (`RoutingView.prompt_ids`; cache_aware: a worker's /tokenize), or None.
    prepare: Callable[[Sequence[Worker], RoutingView], Awaitable[list[int] | None]] | None = None

    def choose(self, candidates: Sequence[Worker], view: RoutingView) -> Worker:
        """`candidates` is never empty; the policy must not mutate it."""
        raise NotImplementedError

    def choose_prefill(self, decode: Worker, prefills: Sequence[Worker], view: RoutingView) -> Choice:
        """As the prefill policy: the pair with `decode`, its prefill one of `prefills` (those compatible with it). A
        policy that predicts what its pick holds (cache_aware) says so in the Choice."""
        return Choice(self.choose(prefills, view), decode)

    def worker_removed(self, worker_id: str) -> None:
        """The worker left the pool for good: forget what is kept about it."""


class RoundRobin(Policy):
    """Each candidate in turn. The counter is global, so with a changing candidate set the turn still rotates."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker], view: RoutingView) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Worker], view: RoutingView) -> Worker:
        return self._rng.choice(candidates)


class PowerOfTwo(Policy):
    """Sample two candidates, take the one with fewer in-flight requests: near-least-loaded without a global scan."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Worker], view: RoutingView) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(list(candidates), 2)
        return first if first.in_flight <= second.in_flight else second


class PrefixAffinity(Policy):
    """Requests sharing a prompt prefix go to the worker that served it, so SGLang's radix cache hits.

    The prompt's text is cut into blocks; each block's key hashes the whole prefix up to it (like SGLang's page keys),
    and a bounded LRU map remembers which worker last served each key. The longest remembered prefix wins, unless that
    worker has `max_imbalance` more requests in flight than the least loaded one: then load wins.
    """

    name = "prefix"

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

    def choose(self, candidates: Sequence[Worker], view: RoutingView) -> Worker:
        keys = self._keys(view.text)
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
