"""The interface every load-balancing policy implements: pick one worker among healthy candidates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.workers import Worker


@dataclass(frozen=True)
class RequestHint:
    """What a policy may look at: the prompt (text, or token ids joined as text) for prefix affinity."""

    prompt: str = ""


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Worker], hint: RequestHint) -> Worker:
        """`candidates` is never empty; the policy must not mutate it."""
        ...
