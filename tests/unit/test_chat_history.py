"""An assistant's message as OpenAI's clients send it back in the history (openai-python's `message.model_dump()`,
which LangChain and the agents SDKs call): OpenAI's fields that SGLang's types lack (refusal, annotations, audio,
function_call) are accepted where harmless, sent as SGLang's field of their meaning where SGLang would drop what
they say, and a 400 naming the field where they cannot be honoured
(router/checks/chat_checks.py's `assistant_fields`)."""

from __future__ import annotations

import json

import httpx
import pytest
from jsonschema import Draft202012Validator
from openai.types.chat import ChatCompletionMessage

from router import openapi
from router.checks.validation import check_chat
from tests.fakes import FakeWorker
from tests.unit.test_pair_needs import CALL, WEATHER, refusal, router

QUESTION = {"role": "user", "content": "Weather in Paris?"}
AGAIN = {"role": "user", "content": "And tomorrow?"}
CITED = [{"type": "url_citation", "url_citation": {"start_index": 0, "end_index": 5, "title": "Météo",
                                                    "url": "https://example.com/paris"}}]
FUNCTION_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def echoed(**fields) -> dict:
    """The answer's message as openai-python dumps it: every field of its type, null where the answer had none."""
    return ChatCompletionMessage.model_validate({"role": "assistant", **fields}).model_dump(mode="json")


def received(body: dict, **capabilities) -> list[list[dict]]:
    """The messages each worker of the pair got (prefill, decode), the router's answer being a 200."""
    prefill, decode = FakeWorker(), FakeWorker()
    with router(prefill, decode, **capabilities) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return [worker.received[0]["messages"] for worker in (prefill, decode)]


def test_an_answer_sent_back_as_the_client_dumped_it_reaches_the_workers_as_sglang_reads_it():
    said = echoed(content="18 C and sunny.", annotations=CITED)
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(said)  # what clients send
    for messages in received({"messages": [QUESTION, said, AGAIN]}):
        assert messages == [QUESTION, {"role": "assistant", "content": "18 C and sunny."}, AGAIN]


def test_a_refusal_is_the_content_of_a_turn_that_has_none():
    refused_turn = echoed(content=None, refusal="I can't help with that.")
    beside = echoed(content="Here it is.", refusal="I can't help with that.")
    for messages in received({"messages": [QUESTION, refused_turn, AGAIN, beside, AGAIN]}):
        assert messages[1] == {"role": "assistant", "content": "I can't help with that."}
        assert messages[3] == {"role": "assistant", "content": "Here it is."}  # what the model said, as said


def test_a_deprecated_function_call_is_one_tool_call_answered_by_its_function_message():
    answer = {"role": "function", "name": "get_weather", "content": "18 C"}
    body = {"messages": [QUESTION, echoed(content=None, function_call=FUNCTION_CALL), answer, AGAIN]}
    for messages in received(body, tool_call_parser="pythonic"):
        assert messages[1] == {"role": "assistant", "tool_calls": [
            {"id": "function_call_1", "type": "function", "function": FUNCTION_CALL}]}
        assert messages[2] == {"role": "tool", "name": "get_weather", "content": "18 C",
                               "tool_call_id": "function_call_1"}
    prefill, decode = FakeWorker(), FakeWorker()
    with router(prefill, decode) as url:  # no tool-call parser: the call could not be rendered as the model's
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[1].function_call"
    assert "--tool-call-parser" in answer.json()["error"]["message"] and not decode.received


AUDIO = {"id": "audio_abc", "data": "UklGR", "expires_at": 1767225600, "transcript": "18 C and sunny."}


@pytest.mark.parametrize(("messages", "param", "fragment"), [
    ([QUESTION, echoed(content=None, audio=AUDIO)], "messages[1].audio", "send its transcript as content"),
    ([QUESTION, {"role": "assistant", "content": "x", "audio": {"id": "audio_abc"}}], "messages[1].audio", "audio"),
    ([{**QUESTION, "refusal": "no"}], "messages[0].refusal", "only an assistant's message has one"),
    ([QUESTION, {"role": "assistant", "content": "x", "refusal": 5}], "messages[1].refusal", "string"),
    ([QUESTION, {"role": "assistant", "content": "x", "annotations": "cited"}], "messages[1].annotations", "list"),
    ([QUESTION, {"role": "assistant", "function_call": FUNCTION_CALL, "tool_calls": [CALL]}],
     "messages[1].function_call", "not both"),
    ([QUESTION, {"role": "assistant", "function_call": {**FUNCTION_CALL, "arguments": "[1]"}}],
     "messages[1].function_call.arguments", "must be a JSON object"),
    ([QUESTION, {"role": "assistant", "function_call": {"name": "get weather", "arguments": "{}"}}],
     "messages[1].function_call.name", "pattern"),
    ([{"role": "tool", "tool_call_id": "c", "content": "x", "function_call": FUNCTION_CALL}],
     "messages[0].function_call", "only an assistant's"),
    ([QUESTION, {"role": "function", "name": "get_weather", "content": "18 C"}], "messages[1].role",
     "answers the function_call of the assistant's message just before it"),
    ([QUESTION, {"role": "assistant", "function_call": FUNCTION_CALL}, {"role": "function", "content": "18 C"},
      {"role": "function", "content": "19 C"}], "messages[3].role", "and only that"),
    ([QUESTION, {"role": "assistant", "function_call": FUNCTION_CALL},
      {"role": "function", "content": "18 C", "tool_call_id": "c"}], "messages[2].tool_call_id", "a tool message"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(messages, param, fragment):
    error = refusal({"messages": messages, "tools": [WEATHER]})
    assert error.param == param and fragment in error.message, error.message


def test_the_contract_takes_the_echoed_message_and_no_audio_answer():
    """The OpenAPI document (from the same inventory) describes what the router takes of a message."""
    document = openapi.document({"openapi": "3.1.0", "info": {"title": "t", "version": "1"}, "paths": {}})
    message = Draft202012Validator({"$ref": "#/components/schemas/Message", "components": document["components"]})
    assert message.is_valid(echoed(content="18 C.", annotations=CITED))
    assert message.is_valid(echoed(content=None, refusal="I can't help with that."))
    assert message.is_valid(echoed(content=None, function_call=FUNCTION_CALL))
    assert message.is_valid({"role": "function", "name": "get_weather", "content": "18 C"})
    assert not message.is_valid(echoed(content=None, audio=AUDIO))
    assert not message.is_valid({"role": "assistant", "function_call": {"name": "get_weather"}})


def test_the_refusal_and_the_call_count_in_the_prompts_bound():
    plain = check_chat({"messages": [QUESTION, {"role": "assistant", "content": "x"}, AGAIN]})
    long = "I can't help with that. " * 100
    refused_turn = check_chat({"messages": [QUESTION, echoed(content=None, refusal=long), AGAIN]})
    assert refused_turn.longest_prompt >= plain.longest_prompt + len(long) - 1
    called = check_chat({"messages": [QUESTION, echoed(content=None, function_call={
        "name": "f", "arguments": json.dumps({"text": long})}), AGAIN]})
    assert called.longest_prompt >= plain.longest_prompt + len(long)
