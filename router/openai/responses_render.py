"""A Responses request as the chat request a PD pair runs, and the chat answer as a Response object (OpenAI's shapes,
as SGLang's own serving_responses.py makes them): a response is a chat completion of the same conversation.

The conversation: `instructions` as a system message first (never stored: OpenAI does not carry them to the next
turn), then the earlier turns' items (the `previous_response_id` chain, from the store), then this turn's input.
Items are messages (their text parts as the chat's), function calls (an assistant's tool_calls, consecutive calls in one
message) and function call outputs (tool messages). The answer: its text as one message item, each tool call as a
function_call item; finish_reason "length" makes the response incomplete (max_output_tokens)."""

from __future__ import annotations

import secrets
import time
from typing import Any

CHAT_ROUTE = "/v1/chat/completions"
Item = dict[str, Any]


def item_id(prefix: str) -> str:
    """An item's id in OpenAI's shape: `msg_`, `fc_` and 48 random hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def input_items(given: str | list[Item]) -> list[Item]:
    """This turn's input as items, each with an id (kept in the store and listed as the response's input items)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        items.append({"id": item_id("fc" if kind == "function_call" else "msg"), **item, "type": kind})
    return items


def _text(content: str | list[Item]) -> str | list[Item]:
    """A message item's content as a chat message's: text, or its text parts as the chat's."""
    if isinstance(content, str):
        return content
    if len(content) == 1:
        return content[0]["text"]
    return [{"type": "text", "text": part["text"]} for part in content]


def messages(items: list[Item]) -> list[Item]:
    """The chat messages of a conversation's items, in order."""
    out: list[Item] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the text or the calls it answered with
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    schema = {key: text_format[key] for key in ("name", "schema", "description", "strict") if key in text_format}
    return {"type": "json_schema", "json_schema": schema}


def chat_body(body: dict[str, Any], conversation: list[Item]) -> dict[str, Any]:
    """The chat request of a checked Responses request (`body`) over its whole conversation's items."""
    chat: dict[str, Any] = {"messages": messages(conversation)}
    if (instructions := body.get("instructions")) is not None:
        chat["messages"].insert(0, {"role": "system", "content": instructions})
    for key in ("model", "temperature", "top_p", "parallel_tool_calls", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the usage of the response.completed event
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                         for tool in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice["name"]}}
    text_format = (body.get("text") or {}).get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    return chat


# What a chat check names, and the Responses field it came from: a 400 names what the client sent.
FIELD_OF = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "response_format.json_schema.schema": "text.format.schema", "messages": "input"}


def client_field(param: str | None) -> str | None:
    if param is None:
        return None
    if param in FIELD_OF:
        return FIELD_OF[param]
    return "input" if param.startswith("messages[") else param


# --- the answer --------------------------------------------------------------------------------------------------

def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat answer's usage in the Responses shape."""
    if not isinstance(chat_usage, dict):
        return None
    prompt, completion = chat_usage.get("prompt_tokens") or 0, chat_usage.get("completion_tokens") or 0
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = chat_usage.get("reasoning_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat_usage.get("total_tokens") or prompt + completion}


def message_item(text: str, status: str = "completed", item: str | None = None) -> Item:
    return {"id": item or item_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item: str | None = None) -> Item:
    return {"id": item or item_id("fc"), "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def output_items(message: dict[str, Any]) -> list[Item]:
    """A chat answer's message as output items: its text (if any, or if it made no call), then its calls."""
    calls = [call for call in message.get("tool_calls") or () if isinstance(call, dict)]
    content = message.get("content")
    out = [message_item(content or "")] if content or not calls else []
    for call in calls:
        function = call.get("function") or {}
        out.append(call_item(call.get("id") or item_id("call"), function.get("name") or "",
                             function.get("arguments") or ""))
    return out


def status_of(finish_reason: Any) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) of an answer that ended for `finish_reason`."""
    return ("incomplete", {"reason": "max_output_tokens"}) if finish_reason == "length" else ("completed", None)


# The request's settings a Response object echoes, kept with a stored response (the store's `settings`).
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "temperature", "top_p", "text",
          "tool_choice", "tools", "user", "store")


def settings(body: dict[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in ECHOED if key in body}


def response_object(response_id: str, body: dict[str, Any], *, status: str, output: list[Item],
                    usage_: dict[str, Any] | None = None, incomplete: dict[str, str] | None = None,
                    created: float | None = None, model: str | None = None) -> dict[str, Any]:
    """A Response object: the answer, and the request's settings as OpenAI echoes them (`body`: the request's)."""
    text_format = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(created or time.time()), "status": status,
        "background": False, "error": None, "incomplete_details": incomplete,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {}, "model": model or body.get("model") or "", "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True),
        "conversation": {"id": body["conversation"]} if body.get("conversation") else None,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "text": {"format": text_format}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "truncation": "disabled", "usage": usage_,
        "user": body.get("user"),
    }


def from_chat(response_id: str, body: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat answer as the Response object."""
    choice = chat["choices"][0]
    status, incomplete = status_of(choice.get("finish_reason"))
    return response_object(response_id, body, status=status, output=output_items(choice.get("message") or {}),
                           usage_=usage(chat.get("usage")), incomplete=incomplete, created=chat.get("created"),
                           model=chat.get("model"))
