"""Load-balancing policies, one module each, chosen by name in the router config."""

from __future__ import annotations

from collections.abc import Callable

from router.policies.base import Policy, RequestHint
from router.policies.power_of_two import PowerOfTwo
from router.policies.prefix import PrefixAffinity
from router.policies.random_choice import RandomChoice
from router.policies.round_robin import RoundRobin

REGISTRY: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    RandomChoice.name: RandomChoice,
    PowerOfTwo.name: PowerOfTwo,
    PrefixAffinity.name: PrefixAffinity,
}


def make_policy(name: str) -> Policy:
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


__all__ = ["Policy", "RequestHint", "REGISTRY", "make_policy"]
