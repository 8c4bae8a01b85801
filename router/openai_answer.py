"""An OpenAI answer as OpenAI types it. SGLang puts `metadata: {"weight_version": ..., "weight_versions": [...]}` in
every whole chat and completions answer, where OpenAI's `metadata` is a map of strings: a strictly typed client
fails to decode such an answer. The values stay, as strings (a list as its JSON text)."""

from __future__ import annotations

import json  # as SGLang wrote the answer: logprobs may be -Infinity, which json reads and writes back, orjson not
from typing import Any


def typed_metadata(payload: bytes) -> bytes:
    """The whole answer with its top-level `metadata` values made strings; any other answer unchanged."""
    try:
        answer: Any = json.loads(payload)
    except ValueError:
        return payload
    metadata = answer.get("metadata") if isinstance(answer, dict) else None
    if not isinstance(metadata, dict) or all(isinstance(v, str) for v in metadata.values()):
        return payload
    answer["metadata"] = {str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
                          for k, v in metadata.items()}
    return json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode()
