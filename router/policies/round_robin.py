from __future__ import annotations

import itertools
from collections.abc import Sequence

from router.policies.base import Policy
from router.workers import Worker


class RoundRobin(Policy):
    """Each candidate in turn. The counter is global, so with a changing candidate set the turn still rotates."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        return candidates[next(self._counter) % len(candidates)]
