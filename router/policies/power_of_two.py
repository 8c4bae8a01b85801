from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy
from router.workers import Worker


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
