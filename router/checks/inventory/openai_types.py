"""The OpenAI routes' structured values as pydantic types: a chat message's text parts, tool calling (OpenAI's function
tools: the tools, the tool choice, an assistant's tool calls), response_format, stream_options, metadata and the
reasoning switches of chat_template_kwargs. The tables that decide each field (router/checks/inventory/openai.py) name
these as the fields' types; what is checked beyond a type is router/checks/chat_checks.py's."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from router.checks.inventory.rules import MAX_NAME_CHARS, MAX_TOOL_TEXT, MAX_TOOLS, Name, Text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ThinkingSwitches(_Strict):
    """The two names SGLang's reasoning code reads a template's switch by (serving_chat.py's
    `_get_reasoning_toggle_param`): a boolean reaches the template as one variable more, which breaks none."""

    enable_thinking: bool | None = None
    thinking: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Strict):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


# OpenAI's metadata: at most 16 pairs, keys of 64 characters, values of 512.
Metadata = Annotated[dict[Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]],
                     Field(max_length=16)]


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Content = Text | Annotated[list[TextPart], Field(min_length=1)]

# Tool calling, as OpenAI's API has it (function tools only). A function's name follows OpenAI's rule; its parameters
# schema is a grammar once tool_choice is required or named, checked as one (router/checks/chat_checks.py).
ToolName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
ToolText = Annotated[StrictStr, Field(max_length=MAX_TOOL_TEXT)]
CallId = Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME_CHARS)]


class ToolFunction(_Strict):
    name: ToolName
    description: ToolText | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: ToolFunction


class FunctionName(_Strict):
    name: ToolName


class NamedTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class CalledFunction(_Strict):
    name: ToolName
    arguments: ToolText  # a JSON object, as text


class ToolCall(_Strict):
    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction
    index: Annotated[StrictInt, Field(ge=0, lt=MAX_TOOLS)] | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedTool
