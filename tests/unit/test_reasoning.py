"""Reasoning models through the router: the answer's `reasoning_content` (what the decode's reasoning parser split off)
reaches the client as the decode wrote it, whole or streamed, one choice or n; the request fields SGLang reads for
reasoning reach both workers as sent, typed, and a 400 names any other (router/checks/inventory/openai.py); a request
that needs the reasoning parser passes only a pair whose two workers run the same one. The workers' parser itself:
tests/unit/test_worker_capabilities.py."""

from __future__ import annotations

import copy
import json
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from pdcluster.common.protocol import WorkerCapabilities
from router.app import create_app
from router.checks.validation import check_chat
from router.config import RouterConfig
from router.fleet.discovery import static_workers
from router.pd.pairing import check_for_pair
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.unit.test_fanout import CHAT, MESSAGES, cluster, events
from tests.unit.test_pair_needs import NONE, limits, refusal

QWEN3 = WorkerCapabilities(reasoning_parser="qwen3")
DEEPSEEK = WorkerCapabilities(reasoning_parser="deepseek-r1")


@contextmanager
def pair(prefill: FakeWorker, decode: FakeWorker, prefill_parser: str | None = "qwen3",
         decode_parser: str | None = "qwen3"):
    """A router in front of one static prefill and one static decode, each declaring its reasoning parser."""
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        config = RouterConfig(bootstrap_url=None, health_interval=0.2, admission_check=False, prefill=[
            {"url": p.url, "kv_bootstrap_port": 8999, "reasoning_parser": prefill_parser}],
            decode=[{"url": d.url, "reasoning_parser": decode_parser}])
        yield stack.enter_context(ServerThread(create_app(config))).url

THOUGHT = ["The user greets me. ", "I greet back."]


@pytest.mark.parametrize("n", [1, 2])
def test_a_whole_answers_reasoning_content_reaches_the_client_untouched(n):
    with cluster([FakeWorker()], [FakeWorker(Behaviour(reasoning=THOUGHT))]) as url:
        answer = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": n}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert [choice["message"] for choice in answer.json()["choices"]] == n * [
        {"role": "assistant", "content": "xxx", "reasoning_content": "".join(THOUGHT)}]


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_answers_reasoning_content_reaches_the_client_untouched(n):
    with cluster([FakeWorker()], [FakeWorker(Behaviour(reasoning=THOUGHT))]) as url:
        answer = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "n": n, "stream": True}, timeout=30)
    assert answer.status_code == 200
    deltas: dict[int, list[dict]] = {}
    for line in events(answer)[:-1]:
        (choice,) = json.loads(line)["choices"]
        deltas.setdefault(choice["index"], []).append(choice["delta"])
    assert sorted(deltas) == list(range(n))
    for delta in deltas.values():  # the reasoning first, piece by piece, as the decode sent it; then the answer
        assert delta[:2] == [{"role": "assistant", "content": None, "reasoning_content": piece} for piece in THOUGHT]
        assert "".join(d["content"] for d in delta[2:]) == "xxx"


def test_the_reasoning_fields_reach_both_workers_as_sent():
    sent = {"separate_reasoning": False, "stream_reasoning": False,
            "chat_template_kwargs": {"enable_thinking": False, "thinking": False}}
    history = [*MESSAGES, {"role": "assistant", "content": "Hello!", "reasoning_content": "".join(THOUGHT)},
               {"role": "user", "content": "How are you?"}]
    prefill, decode = FakeWorker(), FakeWorker()
    with pair(prefill, decode) as url:  # both workers run the same reasoning parser
        answer = httpx.post(f"{url}{CHAT}", json={"messages": history, **sent}, timeout=30)
    assert answer.status_code == 200, answer.text
    for worker in (prefill, decode):
        (body,) = worker.received
        assert {key: body[key] for key in sent} == sent and body["messages"] == history


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"separate_reasoning": "yes"}, "separate_reasoning", "boolean"),
    ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}}, "chat_template_kwargs.chat_template",
     "only SGLang's reasoning switches"),
    ({"chat_template_kwargs": {"reasoning_effort": "high"}}, "chat_template_kwargs.reasoning_effort", "Extra inputs"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs.enable_thinking", "boolean"),
    ({"chat_template_kwargs": {"thinking": 0}}, "chat_template_kwargs.thinking", "boolean"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", ""),
    ({"messages": [{"role": "user", "content": "hi", "reasoning_content": "r"}]}, "messages[0].reasoning_content",
     "only an assistant's"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "x", "reasoning_content": ["r"]}]},
     "messages[1].reasoning_content", "string"),
])
def test_a_reasoning_field_out_of_its_type_is_a_400_naming_it(fields, param, fragment):
    error = refusal({"messages": MESSAGES, **fields})
    assert error.param == param and fragment in error.message, error.message


def test_the_reasoning_in_the_history_counts_in_the_prompts_bound():
    plain = check_chat({"messages": [*MESSAGES, {"role": "assistant", "content": "x"}, *MESSAGES]})
    thought = "A long thought. " * 200
    thinking = check_chat({"messages": [*MESSAGES, {"role": "assistant", "content": "x", "reasoning_content": thought},
                                        *MESSAGES]})
    assert thinking.longest_prompt >= plain.longest_prompt + len(thought)
    assert thinking.prompt_tokens > plain.prompt_tokens


THINKING = [*MESSAGES, {"role": "assistant", "content": "Hello!", "reasoning_content": "They greet me."},
            {"role": "user", "content": "How are you?"}]
# Each field that needs the reasoning parser, as it asks for it: on both workers (the prefill renders the history's
# reasoning by its markers and switches thinking by it; the decode splits the answer by it).
NEEDING = [({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
           ({"chat_template_kwargs": {"thinking": False}}, "chat_template_kwargs"),
           ({"separate_reasoning": True}, "separate_reasoning"),
           ({"stream_reasoning": True, "stream": True}, "stream_reasoning"),
           ({"messages": THINKING}, "messages[1].reasoning_content")]
NO_PARSER = "reasoning needs SGLang's reasoning parser (--reasoning-parser) on both workers of the pair, and the "


@pytest.mark.parametrize(("fields", "param"), NEEDING)
@pytest.mark.parametrize(("prefill", "decode", "problem"), [
    (NONE, NONE, NO_PARSER + "prefill prefill-0 and the decode decode-1 runs none"),
    (QWEN3, NONE, NO_PARSER + "decode decode-1 runs none"),
    (NONE, QWEN3, NO_PARSER + "prefill prefill-0 runs none"),
    (QWEN3, DEEPSEEK, "the pair's workers run different reasoning parsers (prefill prefill-0: qwen3, decode decode-1: "
                      "deepseek-r1); it needs the same on both"),
])
def test_a_request_that_needs_the_reasoning_parser_is_a_400_naming_the_field_through_a_pair_without_one(
        fields, param, prefill, decode, problem):
    error = refusal({"messages": MESSAGES, **copy.deepcopy(fields)}, limits(prefill, decode))
    assert (error.param, error.message) == (param, f"{param}: {problem}")
    check_for_pair(check_chat({"messages": MESSAGES, **copy.deepcopy(fields)}), limits(QWEN3, QWEN3))


@pytest.mark.parametrize("fields", [{"separate_reasoning": False}, {"stream_reasoning": False},
                                    {"chat_template_kwargs": {}}, {"chat_template_kwargs": {"thinking": None}},
                                    {"messages": [*MESSAGES, {"role": "assistant", "content": "x",
                                                              "reasoning_content": None}, *MESSAGES]}])
def test_a_reasoning_field_that_asks_for_nothing_passes_a_pair_without_a_parser(fields):
    checked = check_chat({"messages": MESSAGES, **fields})
    assert checked.needs == ()
    check_for_pair(checked, limits(NONE, NONE))


def test_the_router_answers_a_pair_that_disagrees_on_its_reasoning_parser_with_a_400_that_reaches_no_worker():
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
    prefill, decode = FakeWorker(), FakeWorker()
    with pair(prefill, decode, "qwen3", None) as url:
        refused = httpx.post(f"{url}{CHAT}", json=body, timeout=30)
        plain = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES}, timeout=30)  # asks nothing of it: served
    assert refused.status_code == 400 and refused.json() == {"error": {
        "message": "chat_template_kwargs: " + NO_PARSER + "decode static-decode-0 runs none",
        "type": "invalid_request_error", "param": "chat_template_kwargs", "code": 400}}
    assert plain.status_code == 200 and len(prefill.received) == len(decode.received) == 1
    with pair(FakeWorker(), FakeWorker(), "qwen3", "deepseek-r1") as url:
        refused = httpx.post(f"{url}{CHAT}", json={**body, "stream": True}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "chat_template_kwargs: the pair's workers run different reasoning parsers (prefill static-prefill-0: qwen3, "
        "decode static-decode-0: deepseek-r1); it needs the same on both")


def test_a_static_worker_declares_its_reasoning_parser():
    config = RouterConfig(bootstrap_url=None, decode=[{"url": "http://127.0.0.1:1", "reasoning_parser": "qwen3"}])
    assert static_workers(config)[0].capabilities == QWEN3


EFFORTS = ["none", "minimal", "low", "medium", "high"]


@pytest.mark.parametrize("effort", ["xhigh", "max", "HIGH", "", 0.5, True, ["low"]])
def test_a_reasoning_effort_out_of_the_five_is_a_400_naming_it(effort):
    error = refusal({"messages": MESSAGES, "reasoning_effort": effort}, limits(QWEN3, QWEN3))
    assert error.param == "reasoning_effort" and "'none', 'minimal', 'low', 'medium' or 'high'" in error.message


@pytest.mark.parametrize("effort", EFFORTS)
def test_reasoning_effort_reaches_both_workers_of_a_pair_that_parses_reasoning_and_no_worker_of_one_that_does_not(
        effort):
    """SGLang makes it the template's thinking switches (thinking and enable_thinking, false for "none"): only a
    reasoning parser makes anything of them, so where the pair runs none it is accepted and has no effect."""
    parsing, plain = (FakeWorker(), FakeWorker()), (FakeWorker(), FakeWorker())
    with pair(*parsing) as url:
        sent = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "reasoning_effort": effort}, timeout=30)
    with pair(*plain, None, None) as url:
        accepted = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "reasoning_effort": effort, "n": 2},
                              timeout=30)
    assert sent.status_code == accepted.status_code == 200, accepted.text
    assert [body["reasoning_effort"] for worker in parsing for body in worker.received] == [effort, effort]
    assert len(plain[1].received) == 2 and not any("reasoning_effort" in body for w in plain for body in w.received)


def test_reasoning_effort_through_a_pair_that_disagrees_on_its_reasoning_parser_is_a_400():
    for prefill, decode, names in [("qwen3", None, "qwen3, decode static-decode-0: none"),
                                   ("qwen3", "deepseek-r1", "qwen3, decode static-decode-0: deepseek-r1")]:
        workers = FakeWorker(), FakeWorker()
        with pair(*workers, prefill, decode) as url:
            answer = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "reasoning_effort": "low"}, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"] == {
            "message": f"reasoning_effort: the pair's workers run different reasoning parsers (prefill "
                       f"static-prefill-0: {names}); it needs the same on both (or none on both, where it has no "
                       f"effect)", "type": "invalid_request_error", "param": "reasoning_effort", "code": 400}
        assert workers[0].received == workers[1].received == []
