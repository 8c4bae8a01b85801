"""Pairing: which decode and which prefill serve an attempt. A pipeline of named stages, as llm-d's
filter -> scorer -> picker: filters narrow each role's candidates, then the role's policy picks one.

    decode:  available -> pairable (some available prefill can send it KV) -> holds the prompt -> decode policy
    prefill: available -> compatible with the chosen decode               -> prefill policy

"available": usable (Worker.unusable: registry, probes, liveness, breaker), and not tried already by this request,
unless every available worker of the role has been (then tried ones may serve again). A later choice of an OpenAI
request with `n` (router/openai/fanout.py) keeps to the prefill that holds its prompt already, while it is available.
"Holds the prompt": its KV pool can pre-allocate it (why and how: router/pd/kv_fit.py; else PromptTooLong).
"Compatible": same model identity (model, page size, KV dtype, transfer backend; static workers match anything).
The policies, chosen by name in the router config, are the pickers: each picks one worker among the candidates the
filters left (never an empty list, never to be mutated). `Policy` is the interface with its hooks; REGISTRY names
every policy. Then the pair's limits: the request's token ids and lengths against what both halves can take.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import orjson

from pdcluster.common.http import ApiError
from pdcluster.common.protocol import Role, WorkerCapabilities
from router.checks.chat_checks import check_pair_has
from router.checks.inventory.rules import PairLimit
from router.fleet.workers import Worker, WorkerPool
from router.kv_routing.cache_aware import CacheAware
from router.pd.request import Checked, PdRequest


def available(pool: WorkerPool, role: Role, tried: set[str]) -> list[Worker]:
    workers = [w for w in pool.of_role(role) if not w.unusable()]
    untried = [w for w in workers if w.worker_id not in tried] if tried else workers
    return untried or workers


def pairable(decodes: list[Worker], prefills: list[Worker]) -> list[Worker]:
    return [d for d in decodes if any(p.compatible_with(d) for p in prefills)]


def preferred(prefills: list[Worker], decodes: list[Worker], worker_id: str) -> list[Worker]:
    """Only the prefill `worker_id` if it is available and pairs with an available decode; else all of them."""
    chosen = [p for p in prefills if p.worker_id == worker_id]
    return chosen if pairable(decodes, chosen) else prefills


def compatible_with(decode: Worker, prefills: list[Worker]) -> list[Worker]:
    return [p for p in prefills if p.compatible_with(decode)]


class PromptTooLong(Exception):
    """No candidate decode surely holds the prompt: count it exactly (on `decode`), or refuse it."""

    def __init__(self, decodes: list[Worker]):
        super().__init__("no decode holds the prompt")
        self.decode = max(decodes, key=lambda d: d.prompt_budget or 0)
        self.budget = self.decode.prompt_budget or 0

    def refusal(self, checked: Checked) -> ApiError:
        return ApiError(400, f"{checked.prompt_field} is {checked.longest_prompt} tokens long; the decode workers' KV "
                             f"cache can take prompts of at most {self.budget} tokens (their pools are smaller than "
                             f"the model's context length)", checked.prompt_field)


def holding(decodes: list[Worker], checked: Checked) -> list[Worker]:
    """The decodes that surely hold the prompt; raises PromptTooLong if none does."""
    fit = [d for d in decodes if d.prompt_budget is None or checked.longest_prompt <= d.prompt_budget]
    if not fit and decodes:
        raise PromptTooLong(decodes)
    return fit


class Pairing:
    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy):
        self.pool, self.prefill_policy, self.decode_policy = pool, prefill_policy, decode_policy
        pool.on_removed.append(self.worker_removed)  # the policies forget a worker that left the pool

    def choose(self, request: PdRequest) -> tuple[Worker, Worker]:
        """(prefill, decode) for the request's next attempt; 503 if no pair can serve it."""
        prefills = available(self.pool, Role.PREFILL, request.tried)
        decodes = available(self.pool, Role.DECODE, request.tried)
        if request.prefer_prefill is not None:  # a later choice of a fan-out: where its prompt is cached already
            prefills = preferred(prefills, decodes, request.prefer_prefill)
        candidates = pairable(decodes, prefills)
        if not candidates:
            detail = "no prefill is compatible with any decode" if prefills and decodes else (
                f"{len(prefills)} prefill and {len(decodes)} decode workers available")
            raise ApiError(503, f"no healthy pair: {detail}")
        candidates = holding(candidates, request.checked)
        decode = self.decode_policy.choose_for(candidates, request)
        prefill = self.prefill_policy.choose_for(compatible_with(decode, prefills), request)
        return prefill, decode

    def worker_removed(self, worker_id: str) -> None:
        self.prefill_policy.worker_removed(worker_id)
        self.decode_policy.worker_removed(worker_id)


# --- the policies ----------------------------------------------------------------------------------------------------

class Policy:
    name: str = ""
    # Whether choose() reads the prompt. If not, it gets "" and the prompt is never made into text for it.
    needs_prompt: bool = False
    # Awaited once per request, before its first choice, with the available prefills, if set (cache_aware: token ids).
    prepare: Callable[[Sequence[Worker], PdRequest], Awaitable[None]] | None = None

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        """`candidates` is never empty; the policy must not mutate it. `prompt`: at most HINT_CHARS of the prompt
        as text, if the policy `needs_prompt`."""
        raise NotImplementedError

    def choose_for(self, candidates: Sequence[Worker], request: PdRequest) -> Worker:
        """Pairing's call: a policy that reads more of the request than its text (cache_aware) overrides it."""
        return self.choose(candidates, request.hint if self.needs_prompt else "")

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


def _cache_aware() -> Policy:
    return cast(Policy, CacheAware(PrefixAffinity(), RoundRobin()))  # a Policy by its methods: cannot import this


# Every policy by its name in the router config (router/config.py's POLICIES names the same).
REGISTRY: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    RandomChoice.name: RandomChoice,
    PowerOfTwo.name: PowerOfTwo,
    PrefixAffinity.name: PrefixAffinity,
    "cache_aware": _cache_aware,
}


def make_policy(name: str) -> Policy:
    """A new policy of that name (one the router config accepted: router/config.py's POLICIES)."""
    return REGISTRY[name]()


# --- the pair's limits -----------------------------------------------------------------------------------------------

def pair_limits(prefill: Worker, decode: Worker) -> ModelLimits:
    """What both halves can take (the smaller of what each registered): the prompt's token ids are checked against
    it (check_for_pair)."""
    vocab = [w.vocab_size for w in (prefill, decode) if w.vocab_size is not None]
    context = [w.context_length for w in (prefill, decode) if w.context_length is not None]
    return ModelLimits(min(vocab) if vocab else None, min(context) if context else None,
                       ((f"prefill {prefill.worker_id}", prefill.capabilities),
                        (f"decode {decode.worker_id}", decode.capabilities)))


@dataclass(frozen=True)
class ModelLimits:
    """What a pair of workers can take: ids must be < vocab_size, a prompt at most context_length tokens; and what
    each of the two runs with (named "prefill <id>", "decode <id>"; none known: nothing that needs them passes)."""

    vocab_size: int | None
    context_length: int | None
    capabilities: tuple[tuple[str, WorkerCapabilities], ...] = ()


def check_for_pair(checked: Checked, limits: ModelLimits) -> None:
    """400 naming the field (the bad id and its position, or what the pair lacks); 503: ids that cannot be checked."""
    for field, need in checked.needs:
        check_pair_has(field, need, limits.capabilities)
    _check_prompts(checked, limits)
    vocab = limits.vocab_size
    for field, ids in checked.id_fields:
        if vocab is None:
            raise _unknown_vocabulary(field)
        for position, token in enumerate(ids):
            if token >= vocab:
                raise ApiError(400, f"{field}[{position}] is {token}: token ids must be in [0, {vocab}) for this "
                                    f"model", field)
    context = limits.context_length
    if context is None:
        return
    for field, value, limit in checked.counts:
        if value > context or (limit is PairLimit.POSITION and value >= context):
            raise ApiError(400, f"{field} is {value}; the model's context length is {context}", field)


def _unknown_vocabulary(field: str | None) -> ApiError:
    return ApiError(503, f"{field}: the serving workers' vocabulary size is unknown, so token ids cannot be checked "
                         f"(static workers need vocab_size in the router config)", field)


def _check_prompts(checked: Checked, limits: ModelLimits) -> None:
    if not checked.prompts:
        return
    field = checked.token_ids
    if limits.vocab_size is None:
        raise _unknown_vocabulary(field)
    for item, ids in enumerate(checked.prompts):
        where = f"{field}[{item}]" if checked.batch_size is not None else field
        # Length first: it costs nothing, and bounds the per-id work below by the context length.
        if limits.context_length is not None and len(ids) > limits.context_length:
            raise ApiError(400, f"{where} has {len(ids)} tokens; the model's context length is "
                                f"{limits.context_length}", field)
        if set(map(type, ids)) != {int}:  # bool and float are not token ids
            position = next(i for i, t in enumerate(ids) if type(t) is not int)
            raise ApiError(400, f"{where}[{position}] is {orjson.dumps(ids[position]).decode()[:40]}, not a token "
                                f"id (an integer)", field)
        if min(ids) < 0 or max(ids) >= limits.vocab_size:
            position = next(i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size)
            raise ApiError(400, f"{where}[{position}] is {ids[position]}: token ids must be in "
                                f"[0, {limits.vocab_size}) for this model", field)
