"""Tool calling: accepted only through a pair whose two workers run what it needs (a tool-call parser, the same on
both), a 400 naming the field and what is missing otherwise; seeds through any pair; and the bounds of the
tool-calling fields (router/checks/chat_checks.py, router/checks/inventory/openai.py)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import httpx
import pytest

from pdcluster.common.http import ApiError
from pdcluster.common.protocol import ModelIdentity, Role, WorkerCapabilities, WorkerRegistration, WorkerStatus
from router.app import create_app
from router.checks.inventory.rules import MAX_GRAMMAR_BYTES, PairLimit
from router.checks.validation import check_chat, check_completion, check_generate
from router.config import RouterConfig
from router.fleet.discovery import static_workers
from router.fleet.workers import Worker, WorkerPool
from router.pd.pairing import ModelLimits, check_for_pair, pair_limits
from tests.fakes import FakeWorker, ServerThread


def limits(prefill: WorkerCapabilities, decode: WorkerCapabilities) -> ModelLimits:
    return ModelLimits(1000, 4096, (("prefill prefill-0", prefill), ("decode decode-1", decode)))


PYTHONIC = WorkerCapabilities(tool_call_parser="pythonic")
NONE = WorkerCapabilities()
DETERMINISTIC = WorkerCapabilities(deterministic_inference=True)
PARSING_PAIR = limits(PYTHONIC, PYTHONIC)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}
CALL = {"id": "call_1", "type": "function", "index": 0,
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]} | fields


def second_turn(**fields) -> dict:
    return chat(messages=[{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": "", "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}], **fields)


def refusal(body: dict, pair: ModelLimits = PARSING_PAIR, check=check_chat) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check_for_pair(check(body), pair)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("choice", [None, "auto", "none", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calling_passes_a_pair_with_one_parser(choice):
    body = chat(tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False)
    checked = check_chat(body)
    assert checked.needs == (("tools", PairLimit.TOOL_PARSER),)
    check_for_pair(checked, limits(PYTHONIC, PYTHONIC))


def test_the_answered_calls_and_the_tool_message_pass_and_an_empty_content_is_left_out():
    body = second_turn(tools=[WEATHER])
    check_for_pair(check_chat(body), limits(PYTHONIC, PYTHONIC))
    assert "content" not in body["messages"][1] and body["messages"][1]["tool_calls"] == [CALL]
    alone = second_turn()  # a later turn without tools still has calls to render: the same need
    assert check_chat(alone).needs == (("messages[1].tool_calls", PairLimit.TOOL_PARSER),)
    assert check_chat(chat(tools=[])).needs == ()  # `tools: []` asks for nothing


@pytest.mark.parametrize(("prefill", "decode", "lacking"), [
    (NONE, NONE, "the prefill prefill-0 and the decode decode-1 runs none"),
    (PYTHONIC, NONE, "the decode decode-1 runs none"),
    (NONE, PYTHONIC, "the prefill prefill-0 runs none"),
])
def test_a_pair_without_a_parser_is_a_400_naming_the_field_and_the_worker(prefill, decode, lacking):
    error = refusal(chat(tools=[WEATHER]), limits(prefill, decode))
    assert error.param == "tools" and "--tool-call-parser" in error.message and error.message.endswith(lacking)
    assert refusal(second_turn(), limits(prefill, decode)).param == "messages[1].tool_calls"
    assert refusal(chat(tools=[WEATHER]), ModelLimits(1000, 4096)).param == "tools"  # nothing known: refused


def test_a_pair_with_two_different_parsers_is_a_400():
    error = refusal(chat(tools=[WEATHER]), limits(PYTHONIC, WorkerCapabilities(tool_call_parser="hermes")))
    assert "prefill prefill-0: pythonic, decode decode-1: hermes" in error.message


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(name: str = "f", parameters: dict | None = None, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {}, **extra}}


@pytest.mark.parametrize(("body", "param", "fragment"), [
    (chat(tools=[tool(f"f{i}") for i in range(129)]), "tools", "at most 128"),
    (chat(tools=[tool("get weather")]), "tools[0].function.name", "should match pattern"),
    (chat(tools=[tool("x" * 65)]), "tools[0].function.name", "should match pattern"),
    (chat(tools=[tool(defer_loading=True)]), "tools[0].function.defer_loading", "Extra inputs"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type", "'function'"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice.function.name", "other is not a function of tools"),
    (chat(tool_choice="required"), "tool_choice", "required needs tools"),
    (chat(tools=[WEATHER], tool_choice="any"), "tool_choice", ""),
    (chat(tools=[tool("a", {"description": "x" * (MAX_GRAMMAR_BYTES // 2)}),
                 tool("b", {"description": "y" * (MAX_GRAMMAR_BYTES // 2)})]), "tools", f"over {MAX_GRAMMAR_BYTES}"),
    (chat(tools=[tool(parameters={"type": "string", "pattern": "\U0007b42d"})]), "tools", "U+7B42D"),
    (chat(tools=[tool(parameters=deep(300))]), "tools", "nested too deeply"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "get_weather", "arguments": "[1]"}}]}]), "messages[0].tool_calls[0].function.arguments", "JSON object"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "get_weather", "arguments": "{"}}]}]), "messages[0].tool_calls[0].function.arguments", "JSON object"),
    (chat(messages=[{"role": "tool", "content": "18 C"}]), "messages[0].tool_call_id", "needs one"),
    (chat(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "messages[0].tool_call_id", "only"),
    (chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]), "messages[0].tool_calls", "assistant"),
    (chat(messages=[{"role": "assistant"}]), "messages[0].content", "required"),
    (chat(messages=[{"role": "user", "content": ""}]), "messages[0].content", "at least 1 character"),
    (chat(messages=[{"role": "system", "content": "x", "tools": [WEATHER]}]), "messages[0].tools", "request's tools"),
    (chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role", ""),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep(300)}}),
     "response_format.json_schema.schema", "nested too deeply"),
])
def test_the_tool_fields_are_bounded(body, param, fragment):
    error = refusal(body)
    assert error.param == param and fragment in error.message, error.message


def test_the_tools_and_the_calls_count_in_the_prompts_bound():
    plain = check_chat(chat())
    tools = check_chat(chat(tools=[WEATHER] * 4))
    assert tools.longest_prompt > plain.longest_prompt + 4 * len(str(WEATHER)) and tools.prompt_tokens > \
        plain.prompt_tokens
    assert check_chat(second_turn()).longest_prompt > check_chat(chat()).longest_prompt + 2 * len(CALL["function"][
        "arguments"])


@pytest.mark.parametrize(("check", "body"), [
    (check_chat, chat(seed=7)),
    (check_completion, {"prompt": "a", "seed": 0}),
    (check_generate, {"text": "a", "sampling_params": {"sampling_seed": 7}}),
    (check_generate, {"text": ["a", "b"], "sampling_params": [{}, {"sampling_seed": 1}]}),
])
def test_a_seed_is_served_by_any_pair(check, body):
    """Deterministic where both workers run SGLang's deterministic inference, else at best effort (the answer's
    system_fingerprint says which: tests/unit/test_seeds.py): a seed never breaks a client (lm-eval sends one)."""
    for prefill, decode in [(NONE, NONE), (DETERMINISTIC, NONE), (DETERMINISTIC, DETERMINISTIC)]:
        assert not check(dict(body)).needs
        check_for_pair(check(dict(body)), limits(prefill, decode))


def test_discovered_workers_carry_what_they_registered():
    def registration(role: Role, capabilities: WorkerCapabilities) -> WorkerStatus:
        reg = WorkerRegistration(
            worker_id=f"{role.value}-1", role=role, url="http://127.0.0.1:1", instance_id="a",
            identity=ModelIdentity(model_path="m", served_model_name="m", page_size=1, kv_cache_dtype="auto",
                                   transfer_backend="mooncake"), kv_bootstrap_host="127.0.0.1", kv_bootstrap_port=8999,
            capabilities=capabilities)
        return WorkerStatus(registration=reg, healthy=True, registered_at=0, last_heartbeat=0)

    pool = WorkerPool(admission_check=False)
    pool.sync_discovered([registration(Role.PREFILL, PYTHONIC), registration(Role.DECODE, NONE)])
    prefill, decode = pool.workers["prefill-1"], pool.workers["decode-1"]
    assert prefill.capabilities == PYTHONIC and decode.capabilities == NONE
    assert "the decode decode-1 runs none" in refusal(chat(tools=[WEATHER]), pair_limits(prefill, decode)).message
    pool.sync_discovered([registration(Role.PREFILL, PYTHONIC), registration(Role.DECODE, PYTHONIC)])
    assert pool.workers["decode-1"] is not decode  # another registration: another worker, admitted anew
    check_for_pair(check_chat(chat(tools=[WEATHER])), pair_limits(prefill, pool.workers["decode-1"]))
    assert Worker("w", Role.DECODE, "http://x").capabilities == NONE


@contextmanager
def router(prefill: FakeWorker, decode: FakeWorker, **capabilities):
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        model = {"vocab_size": 1000, "context_length": 4096, **capabilities}
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999, **model}],
                              decode=[{"url": d.url, **model}], health_interval=0.2, admission_check=False)
        yield stack.enter_context(ServerThread(create_app(config))).url


def test_the_router_sends_tool_calling_to_a_pair_with_a_parser_and_refuses_it_otherwise():
    body = second_turn(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    prefill, decode = FakeWorker(), FakeWorker()
    with router(prefill, decode, tool_call_parser="pythonic") as url:
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200
    for worker in (prefill, decode):
        sent = worker.received[0]
        assert sent["tools"] == [WEATHER] and sent["tool_choice"] == "required" and not sent["parallel_tool_calls"]
        assert sent["messages"][1] == {"role": "assistant", "tool_calls": [CALL]}
        assert sent["messages"][2]["tool_call_id"] == "call_1"
    prefill, decode = FakeWorker(), FakeWorker()
    with router(prefill, decode, deterministic_inference=True) as url:
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        seeded = httpx.post(f"{url}/generate", json={"text": "a", "sampling_params": {"sampling_seed": 3}}, timeout=30)
    assert refused.status_code == 400 and refused.json() == {"error": {
        "message": "tools: tool calling needs SGLang's tool-call parser (--tool-call-parser) on both workers of the "
                   "pair, and the prefill static-prefill-0 and the decode static-decode-0 runs none",
        "type": "invalid_request_error", "param": "tools", "code": 400}}
    assert seeded.status_code == 200 and decode.received[0]["sampling_params"] == {"sampling_seed": 3}
    assert len(prefill.received) == len(decode.received) == 1  # the refused request reached neither


def test_a_static_workers_capabilities_are_its_configs():
    config = RouterConfig(bootstrap_url=None, decode=[{"url": "http://127.0.0.1:1", "tool_call_parser": "hermes",
                                                        "deterministic_inference": True}])
    assert static_workers(config)[0].capabilities == WorkerCapabilities(tool_call_parser="hermes",
                                                                         deterministic_inference=True)


def test_an_openai_clients_replayed_answer_passes():
    """The official client sends the assistant's message back as it parsed SGLang's answer: content "", the calls with
    their index, reasoning_content null (openai's model_dump(exclude_unset=True), as it sends a message object)."""
    from openai._compat import model_dump
    from openai.types.chat import ChatCompletionMessage

    answered = ChatCompletionMessage.model_validate({"role": "assistant", "content": "", "reasoning_content": None,
                                                     "tool_calls": [CALL]})
    body = chat(messages=[{"role": "user", "content": "Weather in Paris?"},
                          model_dump(answered, exclude_unset=True, mode="json"),
                          {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]}],
                tools=[WEATHER], tool_choice="none")
    check_for_pair(check_chat(body), PARSING_PAIR)
    assert body["messages"][1] == {"role": "assistant", "tool_calls": [CALL]}
