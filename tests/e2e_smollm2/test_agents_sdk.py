"""OpenAI's Agents SDK (openai-agents, pinned in pyproject.toml) with its default model class, `OpenAIResponsesModel`,
against the router: what the SDK sends with every request (`include: []`, its items as input) is served, and what it
gets back is parsed into its own items. Tracing is off (it would export to OpenAI).

At temperature 0 an agent's answer is the chat answer of the same conversation, token for token: a plain question, and
the next question continued on the server's side (`Runner.run(previous_response_id=...)`, the router's store). A
function tool makes a round trip: SmolLM2-135M's chat template renders no tools, so the first call is forced
(`tool_choice`, as tests/e2e_smollm2/test_tools.py forces it: a grammar of the tool's schema); the SDK runs the tool,
sends the call and its output back as items (tool_choice reset to auto), and the model answers in text."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
from agents.items import ToolCallItem, ToolCallOutputItem

from tests.e2e_smollm2.test_responses import ANSWER, QUESTION
from tests.e2e_smollm2.test_tools import MODEL

NO_TRACING = RunConfig(tracing_disabled=True)
GREEDY = ModelSettings(temperature=0, max_tokens=32)
SKY = {"Paris": "sunny, 18 C", "London": "rain, 12 C", "Tokyo": "cloudy, 21 C"}


@function_tool
def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
    """The current weather in a city."""
    return SKY[city]


@pytest.fixture
def model(cluster) -> OpenAIResponsesModel:
    """A client per test, used within one event loop (its connections are that loop's)."""
    client = openai.AsyncOpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)
    return OpenAIResponsesModel(MODEL, client)


async def run(agent: Agent, question: str, previous_response_id: str | None = None):
    return await Runner.run(agent, question, run_config=NO_TRACING, previous_response_id=previous_response_id,
                            max_turns=3)


def test_an_agent_answers_as_the_chat_and_continues_on_the_server(cluster, model):
    agent = Agent(name="assistant", model=model, model_settings=GREEDY)
    follow_up = "And of Italy?"

    async def two_runs():
        first = await run(agent, QUESTION)
        return first, await run(agent, follow_up, previous_response_id=first.last_response_id)

    first, second = asyncio.run(two_runs())
    assert first.final_output == ANSWER and first.last_response_id
    chat = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)
    reference = chat.chat.completions.create(model=MODEL, temperature=0, max_tokens=32, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": follow_up}])
    assert second.final_output == reference.choices[0].message.content
    (response,) = second.raw_responses
    assert response.usage.input_tokens == reference.usage.prompt_tokens  # the stored turn rebuilt, not just its text


def test_a_function_tool_makes_a_round_trip(model):
    agent = Agent(name="weather", model=model, tools=[get_weather],
                  model_settings=ModelSettings(temperature=0, max_tokens=48, tool_choice="get_weather"))
    result = asyncio.run(run(agent, "What is the weather in Paris?"))
    calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert len(calls) == len(outputs) == 1, result.new_items
    assert calls[0].raw_item.name == "get_weather" and json.loads(calls[0].raw_item.arguments) == {"city": "Paris"}
    assert outputs[0].output == SKY["Paris"]
    assert len(result.raw_responses) == 2  # the call, then the answer to its output
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
