"""Reasoning models through the router: the answer's `reasoning_content` (what the decode's reasoning parser split
off) reaches the client as the decode wrote it, whole or streamed, one choice or n; the request fields SGLang reads
for reasoning reach both workers as sent, typed, and a 400 names any other (router/inventory/openai.py). The workers'
parser itself: tests/unit/test_worker_capabilities.py."""

from __future__ import annotations

import json

import httpx
import pytest

from router.validation import check_chat
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_fanout import CHAT, MESSAGES, cluster, events
from tests.unit.test_pair_needs import refusal

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
    with cluster([prefill], [decode]) as url:
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
