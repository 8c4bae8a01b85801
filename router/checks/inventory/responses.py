"""The OpenAI Responses API (`POST /v1/responses`): every field of the official client's `ResponseCreateParams` and of
an input item, decided. The router serves a response as a chat completion of the same conversation
(router/openai/responses_render.py makes the chat request): the fields that have a chat meaning are sent as that field
(mapped), the router's store keeps and chains the turns (router's own), and what needs OpenAI's hosted tools, its
stored prompts or background runs is refused by name. A field shared with chat that means the same takes its rule."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from router.checks.inventory.native import REASONING, SAMPLING
from router.checks.inventory.openai import CHAT, OPENAI_SERVICE
from router.checks.inventory.openai_types import CallId, Metadata, ToolName, ToolText
from router.checks.inventory.rules import (
    MAX_MESSAGES,
    MAX_TOOLS,
    Count,
    Flag,
    Name,
    PairLimit,
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


class ObfuscationOptions(_Strict):
    include_obfuscation: bool | None = None


RESPONSES: dict[str, Rule] = {
    "model": CHAT["model"],
    "input": bounded(f"text, or 1 to {MAX_MESSAGES} items as in the input item table", Text | Annotated[
        list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]),
    "instructions": mapped("a system message before the input; not carried to the next turn", StrictStr),
    "max_output_tokens": mapped("as max_completion_tokens", Count | None, PairLimit.TOKENS),
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "stream": CHAT["stream"],
    "tools": mapped(f"function tools only, at most {MAX_TOOLS}: sent as the chat's tools",
                    Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)], PairLimit.TOOL_PARSER),
    "tool_choice": mapped("none, auto, required or a function of tools: sent as the chat's",
                          Literal["none", "auto", "required"] | NamedFunction),
    "parallel_tool_calls": CHAT["parallel_tool_calls"],
    "text": mapped("format text, json_object or json_schema: sent as response_format; verbosity ignored",
                   TextConfig),
    "store": router("kept in the router's store (true unless false)", Flag),
    "previous_response_id": router("a stored response of the caller's: its turns come before this input", Name),
    "metadata": ignored("echoed in the answer; not stored", Metadata),
    "user": CHAT["user"],
    "safety_identifier": CHAT["safety_identifier"],
    "prompt_cache_key": CHAT["prompt_cache_key"],
    "service_tier": CHAT["service_tier"],
    "prompt_cache_retention": ignored(OPENAI_SERVICE + " (its cache's retention)", Literal["in-memory", "24h"]),
    "stream_options": ignored("include_obfuscation: events are not padded", ObfuscationOptions),
    "truncation": refused("auto drops the conversation's start to fit: a prompt too long is refused instead",
                          default="disabled"),
    "background": refused("responses are answered while the request is open", default=False),
    "include": refused("no extra output data (logprobs, encrypted reasoning, tool results) is made"),
    "max_tool_calls": refused("a bound on OpenAI's hosted tools: only function tools are served"),
    "prompt": refused(OPENAI_SERVICE + " (its stored prompt templates)"),
    "reasoning": refused(REASONING + "; no reasoning items are made"),
    "top_logprobs": refused("no logprobs are made in a response's output", default=0),
    "conversation": refused("the Conversations API is not served: chain turns with previous_response_id"),
}

# An item of `input`, one table for the three types served: which fields each type takes is checked by the type
# (router/checks/responses_checks.py). Other types (hosted tools' calls, reasoning, item references) are refused there.
INPUT_ITEM: dict[str, Rule] = {
    "type": bounded("message (the default), function_call or function_call_output", ItemType),
    "role": bounded("a message's: user, assistant, system or developer",
                    Literal["user", "assistant", "system", "developer"]),
    "content": bounded("a message's: text, or a list of input_text or output_text parts",
                       StrictStr | Annotated[list[InputText], Field(min_length=1)]),
    "call_id": bounded("a function call's id, and the id of the call a function_call_output answers", CallId,
                       PairLimit.TOOL_PARSER),
    "name": bounded("a function_call's function, a tool's name", ToolName),
    "arguments": bounded("a function_call's: a JSON object, as text", ToolText),
    "output": bounded("a function_call_output's result, as text", StrictStr),
    "id": ignored("the item's id as OpenAI gave it: a stored item gets the router's", Name),
    "status": ignored("an output item's, as it came", Literal["in_progress", "completed", "incomplete"]),
}
