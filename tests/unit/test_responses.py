"""The Responses API (router/openai/responses_*.py) against fake workers, with the official openai client where a user
would use it: a Response object made of the chat answer, plain and streamed (OpenAI's event types, in order, ending in
response.completed), refusals naming the field, the store on SQLite and on a real PostgreSQL (retrieve, input items,
delete, cancel, a previous_response_id chain rebuilt into the chat's messages), and each owner's responses its own."""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner

from router.admission.tenants import Tenancy
from router.app import create_app
from router.config import RouterConfig, StoreConfig
from router.fleet.workers import WorkerPool
from router.metrics import RouterMetrics
from router.openai import responses_render as render
from tests.fakes import Behaviour, FakeWorker, ServerThread

PATH = "/v1/responses"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@contextmanager
def router(decode: FakeWorker | None = None, store: StoreConfig | None = None, **config):
    with ExitStack() as stack:
        prefill = stack.enter_context(ServerThread(FakeWorker().app()))
        decode_url = stack.enter_context(ServerThread((decode or FakeWorker()).app())).url
        parser = {"tool_call_parser": "pythonic"}
        cfg = RouterConfig(bootstrap_url=None, prefill=[{"url": prefill.url, "kv_bootstrap_port": 8999, **parser}],
                           decode=[{"url": decode_url, **parser}], health_interval=0.2,
                           store=store or StoreConfig(backend="none"), **config)
        yield stack.enter_context(ServerThread(create_app(cfg))).url


@pytest.fixture(scope="module")
def storeless_url():
    """One router without a store for the tests that only send refused bodies."""
    with router() as url:
        yield url


def client(url: str, key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


# --- rendering ---------------------------------------------------------------------------------------------------

def test_items_become_the_chat_messages_of_the_conversation():
    items = render.input_items([
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ])
    assert all(item["id"].startswith("fc_" if item["type"] == "function_call" else "msg_") for item in items)
    chat = render.chat_body({"instructions": "be brief", "max_output_tokens": 9, "temperature": 0, "stream": True,
                             "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
                             "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, items)
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city":"{city}"}}'}}
             for c, city in (("c1", "Paris"), ("c2", "Rome"))]
    assert chat == {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": "let me see", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "temperature": 0, "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}}


def test_without_tenants_the_owner_is_the_sha256_of_the_bearer_token_or_anonymous():
    config = RouterConfig(bootstrap_url=None, prefill=[{"url": "http://p", "kv_bootstrap_port": 1}],
                          decode=[{"url": "http://d"}])
    tenancy = Tenancy(config, RouterMetrics(WorkerPool()))

    def owner(headers: dict[str, str]) -> str:
        return tenancy.tenant_of(SimpleNamespace(headers=headers))  # type: ignore[arg-type]

    assert owner({"authorization": "Bearer alice"}) == owner({"authorization": "bearer  alice"}) != "alice"
    assert len(owner({"authorization": "Bearer alice"})) == 64
    assert owner({}) == owner({"authorization": "Basic x"}) == "anonymous"


# --- through the router ------------------------------------------------------------------------------------------

def test_a_response_is_the_chat_answer_and_its_usage_in_the_responses_shape():
    decode = FakeWorker(Behaviour(tokens=["Paris", "."], cached_tokens=2))
    with router(decode) as url:
        response = client(url).responses.create(model="m", input="Capital of France?", instructions="be brief",
                                                max_output_tokens=16, temperature=0, metadata={"k": "v"}, user="u1",
                                                include=[])  # asks for nothing: OpenAI's Agents SDK always sends it
    assert response.output_text == "Paris." and response.id.startswith("resp_")
    # the fake ends every text answer for its length: the response is incomplete, for max_output_tokens
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.input_tokens == 5 and response.usage.output_tokens == 2 and response.usage.total_tokens == 7
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert (response.instructions, response.max_output_tokens, response.metadata) == ("be brief", 16, {"k": "v"})
    sent = decode.received[0]
    assert sent["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "Capital of France?"}]
    assert (sent["max_completion_tokens"], sent["user"]) == (16, "u1")
    assert "input" not in sent and "metadata" not in sent and "include" not in sent


def test_a_stream_is_openais_events_in_order_ending_in_the_whole_response():
    with router(FakeWorker(Behaviour(tokens=["Par", "is"]))) as url:
        events = list(client(url).responses.create(model="m", input="Capital?", stream=True))
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.incomplete"]  # as OpenAI's, for an answer that ended for its length (the fake's all do)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.delta for event in events if event.type == "response.output_text.delta"] == ["Par", "is"]
    final = events[-1].response
    assert final.output_text == "Paris" and final.usage.output_tokens == 2 and final.status == "incomplete"
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_tool_calls_are_function_call_items_plain_and_streamed():
    calls = [("get_weather", '{"city": "Paris"}')]
    with router(FakeWorker(Behaviour(tool_calls=calls))) as url:
        plain = client(url).responses.create(model="m", input="weather?", tools=[WEATHER], tool_choice="required")
        with client(url).responses.stream(model="m", input="weather?", tools=[WEATHER]) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
    for response in (plain, streamed):
        (item,) = response.output
        assert (item.type, item.name, item.arguments, item.call_id) == ("function_call", *calls[0], "call_0")
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]}, "input[0].arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({}, "input"),
])
def test_what_is_not_served_is_a_400_naming_the_field(storeless_url, body, param):
    answer = httpx.post(f"{storeless_url}{PATH}", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_a_stream_that_fails_ends_with_an_error_event_and_nothing_is_stored(tmp_path):
    store = StoreConfig(url=f"sqlite+aiosqlite:///{tmp_path}/responses.db")
    with router(FakeWorker(Behaviour(tokens=["Par", "is"], error_event="the scheduler failed")), store) as url:
        events = list(client(url).responses.create(model="m", input="Capital?", stream=True))
        assert events[-1].type == "error" and "the scheduler failed" in events[-1].message
        assert [event.delta for event in events if event.type == "response.output_text.delta"] == ["Par", "is"]
        with pytest.raises(openai.NotFoundError):
            client(url).responses.retrieve(events[0].response.id)


def test_a_worker_failure_is_openais_error_envelope():
    with router(FakeWorker(Behaviour(status=400, error_message="bad things"))) as url:
        answer = httpx.post(f"{url}{PATH}", json={"input": "x"}, timeout=30)
    assert answer.status_code == 400 and "bad things" in answer.json()["error"]["message"]


# --- the store -----------------------------------------------------------------------------------------------------

def test_stored_responses_chain_and_are_retrieved_listed_and_deleted(store_config):
    decode = FakeWorker(Behaviour(tokens=["Paris"]))
    with router(decode, store_config) as url:
        alice = client(url)
        first = alice.responses.create(model="m", input="Capital of France?", instructions="be brief")
        second = alice.responses.create(model="m", input="And Italy?", previous_response_id=first.id)
        *_, last = alice.responses.create(model="m", input=[{"role": "user", "content": "Spain?"}],
                                          previous_response_id=second.id, stream=True)
        third = last.response  # stored before this last event was sent
        # Each turn is sent the whole conversation; the instructions were the first turn's only.
        assert decode.received[2]["messages"] == [
            {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And Italy?"}, {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "Spain?"}]
        retrieved = alice.responses.retrieve(first.id)  # as created, its settings too
        assert (retrieved.instructions, retrieved.output_text, retrieved.tools) == ("be brief", "Paris", [])
        kept = alice.responses.retrieve(third.id)
        assert (kept.id, kept.output_text, kept.previous_response_id) == (third.id, "Paris", second.id)
        assert kept.usage.output_tokens == third.usage.output_tokens == 1
        (item,) = alice.responses.input_items.list(second.id).data
        assert item.role == "user" and item.content[0].text == "And Italy?"
        with pytest.raises(openai.BadRequestError, match="background"):
            alice.responses.cancel(first.id)
        alice.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as broken:  # the chain now misses its first turn
            alice.responses.create(model="m", input="France?", previous_response_id=third.id)
        assert broken.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.BadRequestError) as large:  # over the store's bound: refused before any worker
            alice.responses.create(model="m", input="x" * 5000)
        assert large.value.body["param"] == "input[0]" and len(decode.received) == 3
        unstored = alice.responses.create(model="m", input="x", store=False)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(unstored.id)


def test_an_owner_never_reads_chains_or_deletes_another_owners_response(tmp_path):
    store = StoreConfig(url=f"sqlite+aiosqlite:///{tmp_path}/responses.db")
    with router(store=store) as url:
        alice, bob = client(url, "alice"), client(url, "bob")
        kept = alice.responses.create(model="m", input="secret")
        for attempt in (lambda: bob.responses.retrieve(kept.id), lambda: bob.responses.delete(kept.id),
                        lambda: bob.responses.cancel(kept.id), lambda: bob.responses.input_items.list(kept.id),
                        lambda: bob.responses.create(model="m", input="x", previous_response_id=kept.id)):
            with pytest.raises(openai.NotFoundError):  # 404, as for an id that does not exist: no oracle
                attempt()
        anonymous = httpx.get(f"{url}{PATH}/{kept.id}", timeout=30)
        assert anonymous.status_code == 404 and json.loads(anonymous.text)["error"]["type"] == "not_found_error"
        assert alice.responses.retrieve(kept.id).output_text == "xxx"  # still there, untouched


def test_openais_agents_sdk_is_served_and_continues_a_stored_chain(tmp_path):
    """OpenAI's Agents SDK with its default model class: what it sends (`include: []`, its settings) is served, and
    Runner.run's previous_response_id continues the chain from the store (the real model: tests/e2e_smollm2)."""
    decode = FakeWorker(Behaviour(tokens=["Paris"]))
    with router(decode, StoreConfig(url=f"sqlite+aiosqlite:///{tmp_path}/responses.db")) as url:
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="alice", max_retries=0, timeout=30)
        agent = Agent(name="a", model=OpenAIResponsesModel("m", sdk), model_settings=ModelSettings(temperature=0))
        untraced = RunConfig(tracing_disabled=True)

        async def two_turns():
            first = await Runner.run(agent, "Capital of France?", run_config=untraced)
            return first, await Runner.run(agent, "And Italy?", run_config=untraced,
                                           previous_response_id=first.last_response_id)

        first, second = asyncio.run(two_turns())
    assert first.final_output == second.final_output == "Paris"
    assert decode.received[1]["messages"] == [{"role": "user", "content": "Capital of France?"},
                                              {"role": "assistant", "content": "Paris"},
                                              {"role": "user", "content": "And Italy?"}]
