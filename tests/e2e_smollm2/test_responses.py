"""The Responses API through the PD cluster with the official openai client: a response is the chat completion of
the same conversation (router/openai/responses_api.py), so every answer here is held to the chat answer of the same
messages, token for token (greedy): plain, streamed (OpenAI's events, ending in response.completed), retrieved from the
router's store, and a previous_response_id chain of three turns, whose rebuilt conversation is exactly the chat's
(the same text and the same prompt tokens). A function call and its output make a round trip as items."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e_smollm2.test_tools import MODEL, WEATHER

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # the chat's (tests/e2e_smollm2/test_smollm2.py)
GREEDY = {"temperature": 0, "max_output_tokens": 32}


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)


def test_a_response_is_the_chat_answer_plain_streamed_and_retrieved(client):
    plain = client.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    assert (plain.output_text, plain.status) == (ANSWER, "completed")
    assert plain.usage.input_tokens == chat(client, [{"role": "user", "content": QUESTION}]).usage.prompt_tokens

    with client.responses.stream(model=MODEL, input=QUESTION, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and streamed.output_text == ANSWER

    kept = client.responses.retrieve(streamed.id)
    assert (kept.id, kept.output_text, kept.usage.output_tokens) == (streamed.id, ANSWER, streamed.usage.output_tokens)


def test_a_chain_of_three_turns_is_the_chat_of_the_whole_conversation(client):
    history: list[dict] = []
    previous = None
    for question in (QUESTION, "And of Italy?", "Which of the two is larger?"):
        turn = client.responses.create(model=MODEL, input=question, previous_response_id=previous, **GREEDY)
        history.append({"role": "user", "content": question})
        reference = chat(client, history)
        assert turn.output_text == reference.choices[0].message.content, question
        assert turn.usage.input_tokens == reference.usage.prompt_tokens, question  # the same prompt, rebuilt
        (item,) = client.responses.input_items.list(turn.id).data  # this turn's own input only
        assert item.content[0].text == question
        history.append({"role": "assistant", "content": turn.output_text})
        previous = turn.id


def test_a_function_call_and_its_output_round_trip_as_items(client):
    tool = {"type": "function", **WEATHER["function"]}
    ask = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                  max_output_tokens=64)
    (call,) = ask.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id, call
    assert json.loads(call.arguments)["city"] == "Paris"
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"city": "Paris", "temperature": 18, "sky": "sunny"})}
    answer = client.responses.create(model=MODEL, input=[result], previous_response_id=ask.id, tools=[tool],
                                     tool_choice="none", temperature=0, max_output_tokens=24)
    assert answer.output[0].type == "message" and answer.output_text.strip(), answer.output
    assert answer.usage.input_tokens > ask.usage.input_tokens  # the call and its result were rendered into the prompt
