"""Every field a worker reads, decided once, with the reason (router/checks/validation.py applies it).

Four tables name every field of SGLang 0.5.23's request types: `GENERATE` and `SAMPLING` (native /generate),
`CHAT` with `MESSAGE` (/v1/chat/completions), `COMPLETION` (/v1/completions); and OpenAI's Responses API
(`RESPONSES` with `INPUT_ITEM`, /v1/responses, served as a chat). Each field is passed (its type
checked), bounded (static limits, or the serving pair's vocabulary and context length), the router's own, or
refused with a 400 that gives the reason. A field in no table is refused too: a new SGLang field is not sent to a
worker until someone decides it here. tests/unit/test_inventory.py compares the tables with SGLang's own types, and
docs/limits.md is generated from them (`python -m router.checks.inventory > docs/limits.md`).
"""

from __future__ import annotations

from router.checks.inventory.native import GENERATE, SAMPLING
from router.checks.inventory.openai import CHAT, COMPLETION, MESSAGE
from router.checks.inventory.responses import INPUT_ITEM, RESPONSES
from router.checks.inventory.rules import Decision, PairLimit, Rule

TABLES: dict[str, dict[str, Rule]] = {
    "/generate": GENERATE,
    "/generate sampling_params": SAMPLING,
    "/v1/chat/completions": CHAT,
    "/v1/chat/completions messages[]": MESSAGE,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSES,
    "/v1/responses input[]": INPUT_ITEM,
}

__all__ = ["CHAT", "COMPLETION", "GENERATE", "INPUT_ITEM", "MESSAGE", "RESPONSES", "SAMPLING", "TABLES", "Decision",
           "PairLimit", "Rule"]
