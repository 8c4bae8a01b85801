"""LiteLLM against the PD cluster, as its users point it at an OpenAI-compatible server (`openai/<model>` with an
api_base): completion and its stream give the official client's tokens, usage included; a forced tool gets a real
call; text completion gives the official client's text. Greedy, as test_langchain.py.

LiteLLM fetches a price list from the internet when imported, unless LITELLM_LOCAL_MODEL_COST_MAP says not to: the
tests talk to 127.0.0.1 only, so it is set before the import (and LiteLLM's own retries are off, so a failure is
seen once, as it happened)."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
import litellm  # after the variable above

from tests.e2e_smollm2.test_tools import MODEL, SCHEMAS, WEATHER

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def routes(cluster) -> dict:
    """What every LiteLLM call gets: the router as an OpenAI-compatible server, no retries, greedy."""
    return {"api_base": f"{cluster.router_url}/v1", "api_key": "unused", "num_retries": 0, "timeout": 300,
            "temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_completion_and_its_stream_give_the_official_clients_answer(client, routes):
    expected = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=64)
    answer = litellm.completion(model=f"openai/{MODEL}", messages=QUESTION, **routes)
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert "Paris" in answer.choices[0].message.content
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    assert answer.usage.completion_tokens == expected.usage.completion_tokens
    chunks = list(litellm.completion(model=f"openai/{MODEL}", messages=QUESTION, stream=True,
                                     stream_options={"include_usage": True}, **routes))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == expected.choices[0].message.content
    rebuilt = litellm.stream_chunk_builder(chunks, messages=QUESTION)  # LiteLLM's own reading of the stream
    assert rebuilt.choices[0].message.content == text
    assert rebuilt.usage.completion_tokens == expected.usage.completion_tokens


def test_a_forced_tool_gets_a_valid_call(routes):
    answer = litellm.completion(model=f"openai/{MODEL}", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                parallel_tool_calls=False, **routes)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id and call.function.name == "get_weather", call
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_text_completion_gives_the_official_clients_text(client, routes):
    expected = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    answer = litellm.text_completion(model=f"openai/{MODEL}", prompt="The capital of France is",
                                     **{**routes, "max_tokens": 8})
    assert answer.choices[0].text == expected.choices[0].text and expected.choices[0].text
