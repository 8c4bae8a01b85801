"""Tool calling through the PD cluster as agents use the OpenAI API (the official openai client): a named or required
tool_choice gets one real call (an id, type function, a tool's name, arguments that parse and fit the tool's schema)
with finish_reason "tool_calls", plain and streamed alike; the next turn, with the call and its result, is answered.

SmolLM2-135M-Instruct's chat template renders no tools, so the model never chooses a call by itself: what is checked is
the cluster's part. Both workers run the pythonic tool-call parser (configs/prefill.yaml says why), with which SGLang
makes a forced tool_choice a JSON-schema grammar of the tools' own schemas: the prefill samples the first token by it,
the decode the rest, and the decode reads the call out of the answer. The schemas hold only enums, so even this model
ends its call within a few dozen tokens. Greedy: the streamed call is the plain one."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required"}
MAX_TOKENS = 64  # a call is ~25 tokens; the grammar ends it, and <|im_end|> after it


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, choice: str, **extra):
    return client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=CHOICES[choice],
                                          parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0, **extra)


def valid_call(call_id: str | None, kind: str | None, name: str | None, arguments: str, choice: str) -> dict:
    """The call's parsed arguments, once every part of it is checked."""
    assert call_id and kind == "function", (call_id, kind)
    assert name == "get_weather" if choice == "named" else name in SCHEMAS, name
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return parsed


def streamed_call(client: openai.OpenAI, choice: str) -> tuple[list[dict], str | None, str]:
    """The stream's calls (assembled from their deltas, by index), its finish_reason, and its text content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in ask(client, choice, stream=True):
        if not chunk.choices:
            continue
        choice_delta = chunk.choices[0]
        finish = choice_delta.finish_reason or finish
        content += choice_delta.delta.content or ""
        for delta in choice_delta.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "type": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["type"] = call["type"] or delta.type
            if delta.function is not None:
                call["name"] = call["name"] or delta.function.name
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("choice", list(CHOICES))
def test_a_forced_tool_choice_gets_one_valid_call_plain_and_streamed(client, choice):
    plain = ask(client, choice).choices[0]
    assert plain.finish_reason == "tool_calls", plain
    assert not plain.message.content and len(plain.message.tool_calls or []) == 1, plain.message
    call = plain.message.tool_calls[0]
    arguments = valid_call(call.id, call.type, call.function.name, call.function.arguments, choice)

    calls, finish, content = streamed_call(client, choice)
    assert finish == "tool_calls" and not content.strip() and len(calls) == 1, (finish, content, calls)
    streamed = calls[0]
    assert valid_call(streamed["id"], streamed["type"], streamed["name"], streamed["arguments"], choice) == arguments
    assert streamed["name"] == call.function.name


def test_the_next_turn_with_the_call_and_its_result_is_answered(client):
    first = ask(client, "named")
    message = first.choices[0].message
    assert message.tool_calls, message
    call = message.tool_calls[0]
    # The assistant's message goes back as the client got it (content "", its calls), then the tool's result.
    history = [*QUESTION, message, {"role": "tool", "tool_call_id": call.id,
                                    "content": json.dumps({"city": "Paris", "temperature": 18, "sky": "sunny"})}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=24, temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls, answer
    assert isinstance(answer.message.content, str) and answer.message.content.strip(), answer.message
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call's result was rendered into the prompt


def test_a_seed_is_served_at_best_effort_because_the_cpu_workers_are_not_deterministic(client):
    """Not SGLang's deterministic inference (refused on CPU): the same seed samples the same tokens on an idle
    cluster (pdcluster/plugins/cpu_seeded_sampling), and the fingerprint says best effort."""
    answers = [client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.0, seed=1)
               for _ in range(2)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert {answer.system_fingerprint for answer in answers} == {"pdcluster-best-effort"}
