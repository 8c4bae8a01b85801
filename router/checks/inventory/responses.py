"""The OpenAI Responses API (`POST /v1/responses`): every field of the official client's `ResponseCreateParams` and of
an input item, decided. The router serves a response as a chat completion of the same conversation
(router/openai/responses_render.py makes the chat request): the fields that have a chat meaning are sent as that field
(mapped), the router's store keeps and chains the turns (router's own), and what needs OpenAI's hosted tools, its
stored prompts or background runs is refused by name. A field shared with chat that means the same takes its rule."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from router.checks.inventory.native import SAMPLING
from router.checks.inventory.openai import CHAT
from router.checks.inventory.openai_types import CallId, Metadata, ToolName, ToolText
from router.checks.inventory.rules import (
    MAX_MESSAGES,
    MAX_TOOLS,
    Count,
    Flag,
    Name,
    Rule,
    Text,
    bounded,
    ignored,
    mapped,
    refused,
    router,
)

ItemType = Literal["message", "function_call", "function_call_output"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Strict):
    """A text part of a message item: the client's (input_text) or the model's, sent back (output_text)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # an output_text's citations: no template renders them
    logprobs: list[dict[str, Any]] | None = None  # an output_text's, as it came: not part of the conversation


class FunctionTool(_Strict):
    """A function tool as the Responses API gives one: the chat tool's function fields, flat."""

    type: Literal["function"]
    name: ToolName
    description: ToolText | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: ToolName


class TextFormat(_Strict):
    """`text.format`: the chat's response_format, its json_schema's fields beside `type` (OpenAI's Responses shape);
    name and schema are required by json_schema (router/checks/responses_checks.py)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a setting of OpenAI's reasoning models: ignored


class ConversationRef(_Strict):
    id: Name


class ObfuscationOptions(_Strict):
    include_obfuscation: bool | None = None


# Sent as the chat's fields of their meaning; the chat's checks then apply (the pair's context length, its parser).
AS_CHAT = "sent as the chat's field of that meaning (instructions: a system message, not carried to the next turn)"
OPENAI_HOSTED = "OpenAI's hosted features"
MAX_NEW_ITEMS = 20  # items of one conversation's create or add, as OpenAI's
NOT_MADE = "outputs not made here"
STORED = "the router's store (kept unless store is false); at most one of previous_response_id and conversation"
ECHOED = "OpenAI's own; metadata is echoed"

RESPONSES: dict[str, Rule] = {
    "model": CHAT["model"],
    "input": bounded(f"text, or 1 to {MAX_MESSAGES} items", Text | Annotated[
        list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]),
    "instructions": mapped(AS_CHAT, StrictStr),
    "max_output_tokens": mapped(AS_CHAT, Count | None),
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "stream": CHAT["stream"],
    "tools": mapped(AS_CHAT, Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)]),
    "tool_choice": mapped(AS_CHAT, Literal["none", "auto", "required"] | NamedFunction),
    "parallel_tool_calls": CHAT["parallel_tool_calls"],
    "text": mapped(AS_CHAT, TextConfig),
    "store": router(STORED, Flag),
    "previous_response_id": router(STORED, Name),
    "metadata": ignored(ECHOED, Metadata),
    "user": CHAT["user"],
    "safety_identifier": CHAT["safety_identifier"],
    "prompt_cache_key": CHAT["prompt_cache_key"],
    "service_tier": CHAT["service_tier"],
    "prompt_cache_retention": ignored(ECHOED, Literal["in-memory", "24h"]),
    "stream_options": ignored(ECHOED, ObfuscationOptions),
    "truncation": refused("a prompt too long is refused instead", default="disabled"),
    "background": refused(OPENAI_HOSTED, default=False),
    "include": refused(NOT_MADE, default=[]),  # OpenAI's Agents SDK always sends one, empty for function tools
    "max_tool_calls": refused(OPENAI_HOSTED),
    "prompt": refused(OPENAI_HOSTED),
    "reasoning": refused(NOT_MADE),
    "top_logprobs": refused(NOT_MADE, default=0),
    "conversation": router(STORED, Name | ConversationRef),
}

# An item of `input`, one table for the three types served: which fields each type takes is checked by the type
# (router/checks/responses_checks.py). Other types (hosted tools' calls, reasoning, item references) are refused there.
ITEM_FIELDS = "those of its type, as OpenAI's"
AS_GIVEN = "a stored item gets the router's id"
INPUT_ITEM: dict[str, Rule] = {
    "type": bounded("message (default), function_call, function_call_output", ItemType),
    "role": bounded(ITEM_FIELDS, Literal["user", "assistant", "system", "developer"]),
    "content": bounded(ITEM_FIELDS, StrictStr | Annotated[list[InputText], Field(min_length=1)]),
    "call_id": bounded(ITEM_FIELDS, CallId),
    "name": bounded(ITEM_FIELDS, ToolName),
    "arguments": bounded(ITEM_FIELDS, ToolText),
    "output": bounded(ITEM_FIELDS, StrictStr),
    "id": ignored(AS_GIVEN, Name),
    "status": ignored(AS_GIVEN, Literal["in_progress", "completed", "incomplete"]),
}
