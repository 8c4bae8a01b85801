"""OpenAI's deprecated function calling, which agent frameworks still send: a chat request's `functions` and
`function_call` are sent as the `tools` and `tool_choice` of their meaning (a request's side is the checks':
router/checks/chat_checks.py's `translate`), and the answer to a request that gave `functions` is written back the
legacy way (router/openai/openai_answer.py): the first call as `message.function_call` (`delta.function_call`,
streamed) instead of `tool_calls`, `finish_reason` "function_call" instead of "tool_calls". Only the first call: a
legacy answer has one. The assistant's `function_call` in the history is a message's field: `assistant_fields`, beside
`translate`.
"""

from __future__ import annotations

import json  # as SGLang wrote the answer: logprobs may be -Infinity, which json reads and writes back, orjson not
from collections.abc import AsyncGenerator
from typing import Any

from router.transport.upstream_response import sse_events

# --- the answer ------------------------------------------------------------------------------------------------------

def _choices(answer: Any) -> list[dict]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return [choice for choice in choices if isinstance(choice, dict)] if isinstance(choices, list) else []


def _finish(choice: dict) -> bool:
    if choice.get("finish_reason") != "tool_calls":
        return False
    choice["finish_reason"] = "function_call"
    return True


def whole(answer: Any) -> bool:
    """A whole chat answer's choices written the legacy way, in place; whether anything was written."""
    changed = False
    for choice in _choices(answer):
        message = choice.get("message")
        if isinstance(message, dict) and "tool_calls" in message:
            calls = message.pop("tool_calls")
            first = calls[0] if isinstance(calls, list) and calls and isinstance(calls[0], dict) else {}
            function = first.get("function")
            if isinstance(function, dict):
                message["function_call"] = {"name": function.get("name"), "arguments": function.get("arguments")}
            changed = True
        changed = _finish(choice) or changed
    return changed


async def stream(chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """A chat stream written the legacy way, event by event: the deltas of each choice's first call as
    `delta.function_call` pieces (its name in the first), the other calls' left out."""
    first_call: dict[Any, Any] = {}  # each choice's index -> the index of its first call
    events = sse_events(chunks)
    try:
        async for event in events:
            if b"tool_calls" in event and event.startswith(b"data: {"):
                event = _event(event, first_call)
            yield event
    finally:  # closed early (the client left): the relay runs its own clean-up
        await events.aclose()
        await chunks.aclose()


def _event(event: bytes, first_call: dict[Any, Any]) -> bytes:
    try:
        data = json.loads(event[6:])
    except ValueError:
        return event
    for choice in _choices(data):
        delta = choice.get("delta")
        if isinstance(delta, dict) and "tool_calls" in delta:
            pieces = [_piece(call, choice.get("index"), first_call) for call in delta.pop("tool_calls") or ()]
            for piece in filter(None, pieces):
                called = delta.setdefault("function_call", {})
                if "name" in piece:
                    called["name"] = piece["name"]
                if "arguments" in piece:
                    called["arguments"] = called.get("arguments", "") + piece["arguments"]
        _finish(choice)
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _piece(call: Any, choice: Any, first_call: dict[Any, Any]) -> dict[str, str] | None:
    """The name and arguments a streamed tool call's delta adds, if it is of the choice's first call."""
    if not isinstance(call, dict) or call.get("index") != first_call.setdefault(choice, call.get("index")):
        return None
    function = call.get("function")
    return {key: value for key, value in function.items() if key in ("name", "arguments") and isinstance(value, str)
            } if isinstance(function, dict) else None
