"""`return_logprob` under PD: the prefill computed the prompt's logprobs, the decode the output's. The client gets
the decode's answer with the prefill's input logprobs put in front, as SGLang's own router does. Only a request that
asked for them (router/pd/request.py's `wants_logprobs`) comes here. And the `text_offset` of /v1/completions' logprobs,
which SGLang leaves at -1 (below)."""

from __future__ import annotations

import json  # to read answers: logprobs may be NaN or -Infinity, which json accepts and orjson not
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from router.transport.upstream_response import sse_events

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


# --- /v1/completions: where each token starts in the text ----------------------------------------------------------
#
# SGLang 0.5.23 writes -1 for every `text_offset`. The router fills them in: each token's offset in its choice's
# `text`, counted from the completion's first character (`text[offset:]` starts with the token), as vLLM does.
# OpenAI's own service counted from the prompt's start (its first offset was the prompt's length; add it for that);
# with `echo` the text starts with the prompt, and so do the offsets (router/pd/echo.py). A token's string is found
# in the text where the last one ended: also after whitespace its string lost (SentencePiece tokens decoded alone),
# and a character split over several tokens (SGLang writes each byte as one latin-1 character) at that character's
# start. A token the text does not show (a special token, a stop string trimmed from the end) starts where the next
# one does.

_LOST_SPACES = 4  # whitespace a token's own string may lack at its start


class TextOffsets:
    """Where each token of one choice starts in its text, fed chunk by chunk (a whole answer is one chunk)."""

    def __init__(self) -> None:
        self.start = 0  # the offset of `tail` in the choice's text
        self.tail = ""  # the text no token covers yet
        self.pending = b""  # the bytes of a character whose tokens have not all come

    def add(self, text: str, tokens: list) -> list[int]:
        """The offsets of `tokens`, the next tokens of the choice, which come with `text`, the next of its text."""
        tail, at, offsets = self.tail + text, 0, []
        for token in tokens:
            offsets.append(self.start + at)
            at = self._cover(tail, at, token if isinstance(token, str) else "")
        self.start, self.tail = self.start + at, tail[at:]
        return offsets

    def _cover(self, tail: str, at: int, token: str) -> int:
        """Where the text no token covers starts once `token` is placed at `at`."""
        if not self.pending:
            if tail.startswith(token, at):
                return at + len(token)
            head = tail[at:at + _LOST_SPACES]
            spaces = len(head) - len(head.lstrip())
            if spaces and token and tail.startswith(token, at + spaces):
                return at + spaces + len(token)
        try:
            piece = self.pending + token.encode("latin-1")
            char = piece.decode()
        except UnicodeEncodeError:  # not a byte of a character: a token the text does not show
            char = None
        except UnicodeDecodeError as error:
            if error.reason == "unexpected end of data":  # the character's next bytes are in the next tokens
                self.pending = piece
                return at
            char = None
        if char is None and self.pending:  # what was pending started no character: the token alone, afresh
            self.pending = b""
            return self._cover(tail, at, token)
        self.pending = b""
        return at + len(char) if char is not None and tail.startswith(char, at) else at


def fill_text_offsets(answer: Any, offsets: dict[int, TextOffsets]) -> bool:
    """Fill `text_offset` in each choice of a completions answer (or stream event) that has logprobs, in place, from
    `offsets` (one per choice index, kept from event to event of a stream). Whether any choice had logprobs."""
    filled = False
    for choice in answer.get("choices") or () if isinstance(answer, dict) else ():
        found = choice.get("logprobs") if isinstance(choice, dict) else None
        if isinstance(found, dict) and isinstance(found.get("tokens"), list) and isinstance(choice.get("text"), str):
            index = choice.get("index")
            state = offsets.setdefault(index if isinstance(index, int) else 0, TextOffsets())
            found["text_offset"] = state.add(choice["text"], found["tokens"])
            filled = True
    return filled


async def stream_text_offsets(chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """A completions stream with the `text_offset` of each event filled in."""
    offsets: dict[int, TextOffsets] = {}
    events = sse_events(chunks)
    try:
        async for event in events:
            if b'"text_offset"' in event and event.startswith(b"data: {"):
                try:
                    data = json.loads(event[6:])
                except json.JSONDecodeError:
                    data = None
                if fill_text_offsets(data, offsets):
                    event = b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
            yield event
    finally:  # closed early (the client left): the relay below runs its own clean-up
        await events.aclose()
        await chunks.aclose()
