"""Load-balancing policies, one module each, chosen by name in the router config; pairing.py puts them to work."""

from __future__ import annotations

from collections.abc import Callable

from router.policies.base import Policy
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


def known_policy(name: str) -> str:
    """`name` if a policy has it (the router config checks its policy names with this), else ValueError."""
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return name


def make_policy(name: str) -> Policy:
    return REGISTRY[known_policy(name)]()


__all__ = ["REGISTRY", "Policy", "known_policy", "make_policy"]
