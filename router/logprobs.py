"""`return_logprob` under PD: the prefill computed the prompt's logprobs, the decode the output's. The client gets
the decode's answer with the prefill's input logprobs put in front, as SGLang's own router does. Only a request that
asked for them (router/request.py's `wants_logprobs`) comes here."""

from __future__ import annotations

import json  # to read answers: logprobs may be NaN or -Infinity, which json accepts and orjson not
from collections.abc import AsyncIterator
from typing import Any

import orjson

INPUT_FIELDS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def _merge_one(decode: dict[str, Any], prefill: dict[str, Any]) -> None:
    d_meta, p_meta = decode.get("meta_info"), prefill.get("meta_info")
    if not isinstance(d_meta, dict) or not isinstance(p_meta, dict):
        return
    for name in INPUT_FIELDS:
        if isinstance(p_meta.get(name), list):
            d_meta[name] = p_meta[name] + (d_meta.get(name) or [])


def merge(decode: Any, prefill: Any) -> Any:
    """Merge a decode answer (an object, or a list for a batch) with the matching prefill answer, in place."""
    if isinstance(decode, list) and isinstance(prefill, list):
        for d, p in zip(decode, prefill, strict=False):
            _merge_one(d, p)
    elif isinstance(decode, dict) and isinstance(prefill, dict):
        _merge_one(decode, prefill)
    return decode


def merge_answer(decode: bytes, prefill: bytes) -> bytes:
    """A whole decode answer with the prefill's input logprobs merged in (JSON in, as the decode sent it)."""
    return orjson.dumps(merge(json.loads(decode), prefill_answer(prefill)))


def prefill_answer(payload: bytes) -> Any:
    """The prefill's answer: a JSON body, or the last `data:` event of its stream."""
    text = payload.decode(errors="replace").strip()
    if text.startswith("data:"):
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        events = [e for e in events if e and e != "[DONE]"]
        text = events[-1] if events else "null"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def merge_first_event(event: bytes, prefill: Any) -> bytes:
    """Merge into the first SSE event of the decode's stream (`data: {...}\\n\\n`)."""
    head, _, rest = event.partition(b"data:")
    try:
        data = json.loads(rest)
    except json.JSONDecodeError:
        return event
    return head + b"data: " + json.dumps(merge(data, prefill)).encode() + b"\n\n"


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events out of a stream's chunks (needed only when the first event must be rewritten)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer:
        yield buffer
