"""The checks across the fields of a chat request that the inventory's types cannot make alone: its grammars as JSON
schemas (response_format's, the tools'), and tool calling (its types: router/checks/inventory/openai_types.py).

A tool's parameters schema is a grammar once tool_choice is required or named: SGLang constrains the answer to calls
of the tools, by a JSON schema or a structural tag made of their schemas, compiled on both workers (some tool-call
parsers make one for automatic calls too). So the schemas of all the tools together get one grammar's limits
(router/checks/inventory/rules.py). The chat template renders the tools and the calls in messages into the prompt: their
bytes count in the prompt's bound (router/pd/request.py's `chat_bound`), twice over, for templates that indent them.
"""

from __future__ import annotations

from typing import Any

import orjson

from pdcluster.common.http import ApiError
from pdcluster.common.protocol import WorkerCapabilities
from router.checks.inventory.rules import MAX_GRAMMAR_BYTES, PairLimit, no_text_code_point

TOOLS_PREAMBLE = 512  # bytes of the text a chat template puts around the tools it renders (how to call them)


def grammar_schema(schema: Any, field: str) -> None:
    """A JSON schema that is (part of) a grammar: within MAX_GRAMMAR_BYTES, and no code point no token is made of
    (a grammar that allows no token crashes the worker that samples it: router/checks/inventory/rules.py)."""
    try:
        text = orjson.dumps(schema).decode()
    except TypeError:  # orjson writes at most 254 levels, and reads up to 1024
        raise ApiError(400, f"{field} is nested too deeply", field) from None
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ApiError(400, f"{field} is over {MAX_GRAMMAR_BYTES} bytes (a grammar, compiled on both workers)", field)
    if (found := no_text_code_point(text)) is not None:
        raise ApiError(400, f"{field}: {found} is an unassigned, private-use or surrogate code point, which no token "
                            "is made of", field)


def response_format_schema(response_format: dict | None) -> None:
    schema = ((response_format or {}).get("json_schema") or {}).get("schema")
    if schema is not None:
        grammar_schema(schema, "response_format.json_schema.schema")


def empty_content_not_given(message: Any) -> None:
    """An assistant message with calls or a refusal, and a tool message, may have an empty content: OpenAI's clients
    send the assistant's answer back as it came, `""` beside its calls. SGLang renders a content left out as empty."""
    if (isinstance(message, dict) and message.get("content") == "" and (message.get("role") in ("tool", "function") or (
            message.get("role") == "assistant" and any(message.get(k) for k in ("tool_calls", "function_call",
                                                                                 "refusal"))))):
        del message["content"]


def assistant_fields(messages: list[dict[str, Any]]) -> None:
    """OpenAI's fields of an assistant message that SGLang would drop, made the SGLang fields of their meaning (their
    types are checked: router/checks/inventory/openai_types.py). A refusal is what the model said when it has no
    content: dropped, the template would render an empty turn. The deprecated function_call is one tool call: dropped,
    the model would not see the call its function's answer follows. Its id is made of the message's index, the same in
    every later turn of the conversation, so the prompt stays a prefix the workers' caches hold."""
    answered = None  # the id of the function_call a function message answers
    for i, message in enumerate(messages):
        where, role = f"messages[{i}].", message["role"]
        for key in ("function_call", "refusal", "reasoning_content"):
            if key in message and role != "assistant":
                raise ApiError(400, f"{where}{key}: only an assistant's message has one", f"{where}{key}")
        refusal = message.pop("refusal", None)
        if refusal and "content" not in message:
            message["content"] = refusal
        if role == "function":
            if "tool_call_id" in message:
                raise ApiError(400, f"{where}tool_call_id: a function message answers the function_call before it "
                                    "(a tool message answers a call by its id)", f"{where}tool_call_id")
            if answered is None:
                raise ApiError(400, f"{where}role: a function message answers the function_call of the assistant's "
                                    "message just before it, and only that", f"{where}role")
            message.update(role="tool", tool_call_id=answered)
        answered = None
        if (call := message.pop("function_call", None)) is not None:
            if message.get("tool_calls"):
                raise ApiError(400, f"{where}function_call: give the calls as tool_calls or as the deprecated "
                                    "function_call, not both", f"{where}function_call")
            _json_object(call["arguments"], f"{where}function_call.arguments")
            answered = f"function_call_{i}"
            message["tool_calls"] = [{"id": answered, "type": "function", "function": call}]


def check_tool_use(body: dict[str, Any], tools_field: str = "tools") -> int:
    """400 for tool calling that cannot work; the bytes the tools and the calls may add to the rendered prompt.
    `tools_field`: what the client named the tools (the deprecated `functions` are sent as tools)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice: required needs tools", "tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
        raise ApiError(400, f"tool_choice.function.name: {choice['function']['name']} is not a function of tools",
                       "tool_choice.function.name")
    added = 0
    if tools:
        # One grammar when tool_choice is required: all the schemas, as SGLang puts them in it.
        grammar_schema([tool["function"].get("parameters") for tool in tools], tools_field)
        added = 2 * len(orjson.dumps(tools)) + TOOLS_PREAMBLE
    for i, message in enumerate(body["messages"]):
        added += _message(message, f"messages[{i}].")
    return added


def _message(message: dict[str, Any], where: str) -> int:
    role, calls = message["role"], message.get("tool_calls")
    if "content" not in message and not (role == "tool" or (role == "assistant" and calls)):
        raise ApiError(400, f"{where}content: required (only an assistant's message with tool_calls, or a tool's, "
                            "may leave it out)", f"{where}content")
    if calls and role != "assistant":
        raise ApiError(400, f"{where}tool_calls: only an assistant's message has them", f"{where}tool_calls")
    if (role == "tool") != ("tool_call_id" in message):
        raise ApiError(400, f"{where}tool_call_id: a tool message needs one, and only a tool message has one",
                       f"{where}tool_call_id")
    for j, call in enumerate(calls or []):
        _json_object(call["function"]["arguments"], f"{where}tool_calls[{j}].function.arguments")
    return 2 * len(orjson.dumps(calls)) if calls else 0


def _json_object(arguments: str, field: str) -> None:
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError(400, f"{field}: must be a JSON object, as text", field)


# Each parser a request may need on both workers of its pair: (what needs it, its name, its WorkerCapabilities field).
_PARSERS = {PairLimit.TOOL_PARSER: ("tool calling", "tool-call parser", "tool_call_parser"),
            PairLimit.REASONING_PARSER: ("reasoning", "reasoning parser", "reasoning_parser")}


def check_pair_has(field: str, need: PairLimit, workers: tuple[tuple[str, WorkerCapabilities], ...]) -> None:
    """Both workers run what `field` needs: the same tool-call parser (each constrains the answer by it, the prefill
    its first token; the decode reads the calls out of it), the same reasoning parser (each renders the reasoning of
    the history by its markers and switches thinking by it; the decode splits the answer by it; for reasoning_effort,
    which SGLang makes the thinking switches, or none on both)."""
    if need in _PARSERS:
        what, parser, attribute = _PARSERS[need]
        named = [(name, getattr(caps, attribute)) for name, caps in workers]
        lacking = " and the ".join(name for name, found in named if found is None)
        if lacking or not workers:
            raise ApiError(400, f"{field}: {what} needs SGLang's {parser} (--{parser.replace(' ', '-')}) on both "
                                f"workers of the pair, and the {lacking or 'pair'} runs none", field)
        if len({found for _, found in named}) > 1:
            raise ApiError(400, f"{field}: the pair's workers run different {parser}s (" + ", ".join(
                f"{name}: {found}" for name, found in named) + "); it needs the same on both", field)
    elif len({caps.reasoning_parser for _, caps in workers}) > 1:  # REASONING_EFFORT: one parser or none on both
        raise ApiError(400, f"{field}: the pair's workers run different reasoning parsers (" + ", ".join(
            f"{name}: {caps.reasoning_parser or 'none'}" for name, caps in workers) + "); it needs the same on "
            "both (or none on both, where it has no effect)", field)


# --- OpenAI's deprecated function calling (its answer: router/openai/legacy_functions.py) ----------------------

def translate(body: dict[str, Any]) -> bool:
    """`functions` as tools, `function_call` as tool_choice, in place; whether the request gave `functions` (then its
    answer is written back the legacy way). 400 for the legacy fields mixed with the new ones."""
    functions, choice = body.pop("functions", None), body.pop("function_call", None)
    if functions is not None and "tools" in body:
        raise ApiError(400, "functions: give the functions as tools or as the deprecated functions, not both",
                       "functions")
    if choice is not None and ("tools" in body or "tool_choice" in body):
        raise ApiError(400, "function_call: the deprecated function_call goes with functions (with tools, give "
                            "tool_choice)", "function_call")
    if functions is not None and "tool_choice" in body:
        raise ApiError(400, "tool_choice: goes with tools (with the deprecated functions, give function_call)",
                       "tool_choice")
    if functions is not None:
        body["tools"] = [{"type": "function", "function": function} for function in functions]
    if isinstance(choice, dict):
        if choice["name"] not in {function["name"] for function in functions or ()}:
            raise ApiError(400, f"function_call.name: {choice['name']} is not a function of functions",
                           "function_call.name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    return functions is not None
