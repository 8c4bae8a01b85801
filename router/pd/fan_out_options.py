"""How one choice of an OpenAI request for `n` choices (router/openai/fanout.py) is served apart from a lone request:
the options the fan-out gives each choice's request, read where it is served (router/service.py) and attempted
(router/pd/attempt.py). Such a request is timed by the fan-out, as its merged answer, not by its own attempts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from router.fleet.workers import Worker


@dataclass(slots=True)
class FanOutOptions:
    # A later choice's: the prefill that holds the prompt, once the first choice is paired (pairing keeps to it while
    # it is available, and the prefill policy's `prepare` is skipped).
    prefer_prefill: str | None = None
    # The first choice's: called when an attempt's prefill half is sent, with its prefill and the half's future.
    on_paired: Callable[[Worker, asyncio.Future], None] | None = None
    # A later choice's: what each of its prefill halves waits for before it is sent (the first's prompt cached).
    prefill_gate: asyncio.Future | None = None
