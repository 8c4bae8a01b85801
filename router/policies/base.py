"""The interface every load-balancing policy implements: pick one worker among candidates (router/policies/pairing.py
has already filtered them), and the hooks it may use."""

from __future__ import annotations

from collections.abc import Sequence

from router.workers import Worker


class Policy:
    name: str = ""
    # Whether choose() reads the prompt. If not, it gets "" and the prompt is never made into text for it.
    needs_prompt: bool = False

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        """`candidates` is never empty; the policy must not mutate it. `prompt`: at most HINT_CHARS of the prompt
        as text, if the policy `needs_prompt`."""
        raise NotImplementedError

    def worker_removed(self, worker_id: str) -> None:
        """The worker left the pool for good: forget what is kept about it."""
