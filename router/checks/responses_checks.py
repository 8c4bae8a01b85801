"""The checks of a Responses request (`POST /v1/responses`) before it is made a chat request: its fields by the
inventory's tables (router/checks/inventory/responses.py), each input item by the fields its type takes, and the rules
across fields that name the Responses field (a named tool_choice's function among the tools, a json_schema format's
name and schema). What the chat request then adds (grammars, the pair's limits) is the chat's checks'."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from pdcluster.common.http import ApiError
from router.checks.inventory.openai_types import Metadata
from router.checks.inventory.responses import MAX_NEW_ITEMS
from router.checks.validation import apply_table

_METADATA: TypeAdapter = TypeAdapter(Metadata | None)

# The fields each input item type takes beside `type`, all required.
ITEM_FIELDS: dict[str, tuple[str, ...]] = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
}


def check_responses(body: dict[str, Any]) -> None:
    """400 naming the field for anything the router does not serve; the ignored fields are left out of `body`."""
    apply_table("responses", body)
    items = body["input"]
    if isinstance(items, list):
        for i, item in enumerate(items):
            check_item(item, f"input[{i}].")
    text_format = (body.get("text") or {}).get("format") or {}
    if text_format.get("type") == "json_schema":
        for key in ("name", "schema"):
            if text_format.get(key) is None:
                raise ApiError(400, f"text.format.{key}: required by a json_schema format", f"text.format.{key}")
    if body.get("conversation") is not None and body.get("previous_response_id") is not None:
        raise ApiError(400, "conversation: give a conversation or a previous_response_id, not both", "conversation")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice["name"] not in {tool["name"] for tool in body.get("tools") or ()}:
        raise ApiError(400, f"tool_choice.name: {choice['name']} is not a function of tools", "tool_choice.name")


def check_item(item: Any, where: str) -> None:
    """An input item (of a response, or added to a conversation) as its type takes it."""
    kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else "message"
    if not isinstance(kind, str) or kind not in ITEM_FIELDS:
        raise ApiError(400, f"{where}type: an item is a message, function_call or function_call_output (OpenAI's "
                            "hosted tools' items, reasoning and item references are not served)", f"{where}type")
    apply_table("input item", item, where)
    required = ITEM_FIELDS[kind]
    for key in required:
        if key not in item:
            raise ApiError(400, f"{where}{key}: required in a {kind} item", f"{where}{key}")
    for key in item:
        if key not in (*required, "type"):
            raise ApiError(400, f"{where}{key}: a {kind} item has no {key}", f"{where}{key}")
    if kind == "function_call":
        try:
            arguments = orjson.loads(item["arguments"])
        except orjson.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ApiError(400, f"{where}arguments: must be a JSON object, as text", f"{where}arguments")


def check_conversation_body(body: dict[str, Any], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """A conversation's create (`items`, `metadata`) or items' add (`items`, required) body; its items, checked as a
    response's input items are (at most MAX_NEW_ITEMS, as OpenAI's)."""
    for key in body:
        if key not in fields:
            raise ApiError(400, f"{key}: unknown field (this route takes {', '.join(fields)})", key)
    items = body.get("items")
    if items is None and "metadata" not in fields:
        raise ApiError(400, "items: required", "items")
    if items is not None and (not isinstance(items, list) or len(items) > MAX_NEW_ITEMS):
        raise ApiError(400, f"items: a list of at most {MAX_NEW_ITEMS} items", "items")
    for i, item in enumerate(items or ()):
        check_item(item, f"items[{i}].")
    try:
        _METADATA.validate_python(body.get("metadata"), strict=True)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in ("metadata", *problem["loc"]))
        raise ApiError(400, f"{where}: {problem['msg']}", "metadata") from None
    return items or []
