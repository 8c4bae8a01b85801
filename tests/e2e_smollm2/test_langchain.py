"""LangChain's ChatOpenAI against the PD cluster, as an agent framework drives it: invoke and stream give the tokens
the official client gets, bind_tools with a forced tool gets a real call, and structured output works both ways
(function calling, which sends a named tool_choice with parallel_tool_calls false, and a strict JSON schema).
Greedy, and the tools' schemas hold only enums, so even SmolLM2-135M ends each answer within a few dozen tokens."""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.e2e_smollm2.test_tools import MODEL, SCHEMAS, WEATHER

QUESTION = "What is the capital of France?"


class Weather(BaseModel):
    """The current weather in a city"""

    city: Literal["Paris", "London", "Tokyo"]
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def chat(cluster) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{cluster.router_url}/v1", api_key="unused", temperature=0,
                      max_tokens=64, max_retries=0, timeout=300)


def test_invoke_and_stream_give_the_official_clients_answer(cluster, chat):
    client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)
    expected = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=64).choices[0].message.content
    assert expected and "Paris" in expected, expected
    assert chat.invoke(QUESTION).content == expected
    assert "".join(str(chunk.content) for chunk in chat.stream(QUESTION)) == expected


def test_bind_tools_with_a_forced_tool_gets_a_valid_call(chat):
    answer = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert len(answer.tool_calls) == 1, answer
    call = answer.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"], call
    assert set(call["args"]) == set(SCHEMAS["get_weather"]["required"]), call
    assert answer.response_metadata["finish_reason"] == "tool_calls", answer.response_metadata


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output_both_ways(chat, method):
    weather = chat.with_structured_output(Weather, method=method).invoke("What is the weather in Paris?")
    assert isinstance(weather, Weather), weather
