"""Every routing policy, by the name the router config gives it: the one registry, as llm-d registers its plugins in
one file. The simple policies are router/routing/policy.py's; cache_aware (router/kv_routing/cache_aware.py) falls
back to two of them.
"""

from __future__ import annotations

from collections.abc import Callable

from router.kv_routing.cache_aware import CacheAware
from router.routing.policy import Policy, PowerOfTwo, PrefixAffinity, RandomChoice, RoundRobin


def _cache_aware() -> Policy:
    return CacheAware(PrefixAffinity(), RoundRobin())


REGISTRY: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    RandomChoice.name: RandomChoice,
    PowerOfTwo.name: PowerOfTwo,
    PrefixAffinity.name: PrefixAffinity,
    CacheAware.name: _cache_aware,
}


def make_policy(name: str) -> Policy:
    """A new policy of that name (one the router config accepted: router/config.py's POLICIES)."""
    return REGISTRY[name]()
