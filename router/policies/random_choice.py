from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy
from router.workers import Worker


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        return self._rng.choice(candidates)
