"""Every routing policy, by the name the router config gives it: the one registry, as llm-d registers its plugins in
one file. The simple policies are router/routing/policy.py's; cache_aware (router/kv_routing/cache_aware.py) falls
back to two of them. The config, the router's lowest module, cannot import this: whoever loads one passes these
names as its validation context (router/__main__.py; router/config.py's PolicyName), and `make_policy` refuses any
other name with the same error, for a config made in code.
"""

from __future__ import annotations

from collections.abc import Callable

from router.config import check_policy
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
    """A new policy of that name; ValueError, naming the known ones, for any other."""
    return REGISTRY[check_policy(name, REGISTRY)]()
