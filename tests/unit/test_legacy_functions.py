"""OpenAI's deprecated function calling through the router (router/openai/legacy_functions.py): `functions` and
`function_call` are sent as tools and tool_choice, refused as tools are through a pair without a tool-call parser, and
the answer comes back the legacy way, whole and streamed: the first call as `function_call`, finish_reason
"function_call", no `tool_calls`."""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from router.checks.inventory.rules import MAX_GRAMMAR_BYTES, PairLimit
from router.checks.validation import check_chat
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_fanout import events
from tests.unit.test_pair_needs import WEATHER, chat, refusal, router

CHAT = "/v1/chat/completions"
FUNCTION = WEATHER["function"]
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "London"}')]


def legacy(**fields) -> dict:
    return chat(functions=[FUNCTION], **fields)


@pytest.mark.parametrize(("function_call", "tool_choice"), [
    (None, None), ("none", "none"), ("auto", "auto"),
    ({"name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}})])
def test_functions_and_function_call_are_checked_as_tools_and_tool_choice(function_call, tool_choice):
    body = legacy(function_call=function_call)
    checked = check_chat(body)
    assert checked.legacy_functions and checked.needs == (("functions", PairLimit.TOOL_PARSER),)
    assert body["tools"] == [WEATHER] and body.get("tool_choice") == tool_choice
    assert "functions" not in body and "function_call" not in body
    assert not check_chat(chat(tools=[WEATHER])).legacy_functions


@pytest.mark.parametrize(("body", "param", "fragment"), [
    (legacy(tools=[WEATHER]), "functions", "not both"),
    (chat(tools=[WEATHER], function_call="auto"), "function_call", "goes with functions"),
    (legacy(function_call="auto", tool_choice="auto"), "function_call", "goes with functions"),
    (legacy(tool_choice="required"), "tool_choice", "goes with tools"),
    (legacy(function_call="required"), "function_call", "'none' or 'auto'"),
    (legacy(function_call={"name": "other"}), "function_call.name", "other is not a function of functions"),
    (chat(function_call={"name": "get_weather"}), "function_call.name", "not a function of functions"),
    (legacy(function_call={"name": "get_weather", "arguments": "{}"}), "function_call.arguments", "Extra inputs"),
    (chat(functions=[{**FUNCTION, "name": "get weather"}]), "functions[0].name", "should match pattern"),
    (chat(functions=[WEATHER]), "functions[0].name", "Field required"),  # a tool is not a function
    (chat(functions=[{"name": f"f{i}"} for i in range(129)]), "functions", "at most 128"),
    (chat(functions=[{"name": "a", "parameters": {"description": "x" * MAX_GRAMMAR_BYTES}}]), "functions",
     f"over {MAX_GRAMMAR_BYTES}"),
])
def test_the_legacy_fields_out_of_their_rules_are_a_400_naming_the_field(body, param, fragment):
    error = refusal(body)
    assert error.param == param and fragment in error.message, error.message


def test_the_router_sends_functions_as_tools_and_refuses_them_as_tools_through_a_pair_without_a_parser():
    body = legacy(function_call={"name": "get_weather"})
    prefill, decode = FakeWorker(), FakeWorker()
    with router(prefill, decode, tool_call_parser="pythonic") as url:
        answer = httpx.post(f"{url}{CHAT}", json=body, timeout=30)
    assert answer.status_code == 200
    for worker in (prefill, decode):
        (sent,) = worker.received
        assert sent["tools"] == [WEATHER] and sent["tool_choice"] == {"type": "function", "function": {
            "name": "get_weather"}}
        assert "functions" not in sent and "function_call" not in sent
    prefill, decode = FakeWorker(), FakeWorker()
    with router(prefill, decode) as url:
        refused = httpx.post(f"{url}{CHAT}", json=body, timeout=30)
    assert refused.status_code == 400 and refused.json() == {"error": {
        "message": "functions: tool calling needs SGLang's tool-call parser (--tool-call-parser) on both workers of "
                   "the pair, and the prefill static-prefill-0 and the decode static-decode-0 runs none",
        "type": "invalid_request_error", "param": "functions", "code": 400}}
    assert prefill.received == decode.received == []


@pytest.mark.parametrize("n", [1, 2])
def test_a_whole_answer_to_functions_is_the_first_call_as_function_call(n):
    with router(FakeWorker(), FakeWorker(Behaviour(tool_calls=CALLS)), tool_call_parser="pythonic") as url:
        answer = httpx.post(f"{url}{CHAT}", json=legacy(n=n), timeout=30)
        tools = httpx.post(f"{url}{CHAT}", json=chat(tools=[WEATHER]), timeout=30)
    assert answer.status_code == 200, answer.text
    for choice in answer.json()["choices"]:
        assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
        assert choice["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    parsed = ChatCompletion.model_validate(answer.json())  # as the official client reads it
    assert [c.message.function_call.name for c in parsed.choices if c.message.function_call] == n * ["get_weather"]
    (asked,) = tools.json()["choices"]  # asked with tools: the calls as SGLang answered them
    assert asked["finish_reason"] == "tool_calls" and len(asked["message"]["tool_calls"]) == 2


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_answer_to_functions_is_the_first_call_as_function_call_deltas(n):
    with router(FakeWorker(), FakeWorker(Behaviour(tool_calls=CALLS)), tool_call_parser="pythonic") as url:
        answer = httpx.post(f"{url}{CHAT}", json=legacy(n=n, stream=True, stream_options={"include_usage": True}),
                            timeout=30)
    assert answer.status_code == 200
    lines = events(answer)
    assert lines[-1] == "[DONE]" and "tool_calls" not in "".join(lines)
    chunks = [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines[:-1]]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == n * 4
    for index in range(n):
        choices = [c for chunk in chunks for c in chunk.choices if c.index == index]
        called = [c.delta.function_call for c in choices if c.delta.function_call is not None]
        assert [call.name for call in called] == ["get_weather", None, None]  # the name once, then the arguments
        assert "".join(call.arguments or "" for call in called) == '{"city": "Paris"}'  # the first call's only
        assert [c.finish_reason for c in choices if c.finish_reason] == ["function_call"]
        assert choices[-1].finish_reason == "function_call"
