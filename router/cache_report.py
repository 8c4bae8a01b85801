"""How much of each prompt the workers had cached, read from the decode's answer for the router's metrics.

SGLang reports `meta_info.cached_tokens` on every native answer, and `cached_tokens_details` ({"device", "host",
"storage"}: which tier of HiCache held them) when any were cached; in PD mode the prefill's counts travel to the
decode, whose answer the router relays. OpenAI answers carry `usage.prompt_tokens_details.cached_tokens` when the
workers run with `enable-cache-report`. The answer is scanned, not parsed: a few microseconds per answer.
"""

from __future__ import annotations

import re

_TOTAL = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_DETAILS = re.compile(rb'"cached_tokens_details"\s*:\s*\{([^}]*)\}')
_TIER = re.compile(rb'"(device|host|storage)"\s*:\s*(\d+)')


def cached_tokens(answer: bytes) -> dict[str, int]:
    """{"total": n, "device": d, "host": h, "storage": s} summed over the items of the answer (a batch has several);
    tiers only where SGLang reported them. For a stream, pass its last event: SGLang's counts are cumulative."""
    found: dict[str, int] = {}
    for match in _TOTAL.finditer(answer):
        found["total"] = found.get("total", 0) + int(match.group(1))
    for details in _DETAILS.finditer(answer):
        for tier, count in _TIER.findall(details.group(1)):
            found[tier.decode()] = found.get(tier.decode(), 0) + int(count)
    return found
