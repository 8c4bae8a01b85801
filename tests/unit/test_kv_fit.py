"""A decode whose KV pool is smaller than its context (router/pd/kv_fit.py) gets only prompts it can pre-allocate; a
prompt no decode can take is a 400 naming the limit, at once, instead of SGLang's wait for room until the prefill's
bootstrap timeout. Fake workers (tests/fakes.py): their /tokenize counts a token per two characters."""

from __future__ import annotations

import httpx
import pytest

from tests.fakes import FakeWorker
from tests.unit.test_admission import discovered

LIMITS = {"vocab_size": 1000, "context_length": 2048}
# A pool of 1000 tokens, 100 reserved per prompt, pages of one token: prompts of at most 1000 - 100 - 1 = 899.
SMALL = LIMITS | {"kv_pool_tokens": 1000, "reserved_decode_tokens": 100}
BIG = LIMITS | {"kv_pool_tokens": 4096, "reserved_decode_tokens": 100}
BUDGET = 899


def ids(n: int) -> list[int]:
    return [i % 1000 for i in range(n)]


def served_by(router: str, body: dict) -> str:
    response = httpx.post(f"{router}/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers["x-pdcluster-decode"]


def test_a_long_prompt_goes_to_the_decode_that_holds_it_and_short_ones_to_either():
    small, big = FakeWorker(), FakeWorker()
    fakes = {"p": FakeWorker(), "d-small": small, "d-big": big}
    with discovered(fakes, {"p": "prefill", "d-small": "decode", "d-big": "decode"},
                    extra={"p": LIMITS, "d-small": SMALL, "d-big": BIG}) as (_, _urls, router):
        budgets = {w["worker_id"]: w["prompt_budget"] for w in httpx.get(f"{router}/ready").json()["workers"]}
        assert budgets == {"p": None, "d-small": BUDGET, "d-big": None}
        assert {served_by(router, {"input_ids": ids(BUDGET + 1)}) for _ in range(6)} == {"d-big"}
        assert {served_by(router, {"text": "y" * 2000}) for _ in range(6)} == {"d-big"}  # 2008 bytes: maybe too long
        assert small.tokenized == [] and big.tokenized == []  # the big decode holds anything: nothing to count
        assert {served_by(router, {"input_ids": ids(BUDGET)}) for _ in range(12)} == {"d-small", "d-big"}


@pytest.fixture(scope="module")
def only_small():
    small = FakeWorker()
    fakes = {"p": FakeWorker(), "d-small": small}
    with discovered(fakes, {"p": "prefill", "d-small": "decode"}, extra={"p": LIMITS, "d-small": SMALL}) as (
            _, _urls, router):
        yield router, small


def test_token_ids_over_the_budget_are_a_400_naming_the_field_and_the_limit(only_small):
    router, small = only_small
    sent = len(small.received)
    response = httpx.post(f"{router}/generate", json={"input_ids": ids(BUDGET + 1)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input_ids"
    assert error["message"] == (f"input_ids is {BUDGET + 1} tokens long; the decode workers' KV cache can take "
                                f"prompts of at most {BUDGET} tokens (their pools are smaller than the model's "
                                f"context length)")
    batch = httpx.post(f"{router}/v1/completions", json={"prompt": [ids(3), ids(BUDGET + 1)], "max_tokens": 1})
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "prompt"
    assert len(small.received) == sent  # no worker saw them
    assert small.tokenized == []  # ids are counted by the router
    assert served_by(router, {"input_ids": ids(BUDGET)}) == "d-small"


@pytest.mark.parametrize(("route", "body", "field", "tokens"), [
    ("/generate", {"text": "y" * 2 * (BUDGET + 1)}, "text", BUDGET + 1),
    ("/generate", {"text": ["y", "y" * 2 * (BUDGET + 1)]}, "text", BUDGET + 1),
    ("/v1/completions", {"prompt": "y" * 3000, "max_tokens": 1}, "prompt", 1500),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 2000}]}, "messages", 1004),
])
def test_text_that_may_be_too_long_is_counted_by_the_decode_and_refused_when_it_is(only_small, route, body, field,
                                                                                   tokens):
    router, small = only_small
    asked = len(small.tokenized)
    response = httpx.post(f"{router}{route}", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert response.json()["error"]["message"].startswith(f"{field} is {tokens} tokens long; ")
    assert len(small.tokenized) == asked + 1
    asked_for = small.tokenized[-1]
    assert asked_for == ({"messages": body["messages"]} if field == "messages" else {"prompt": body.get("text",
                                                                                     body.get("prompt"))})


def test_text_whose_bytes_may_exceed_the_budget_but_whose_tokens_do_not_is_served(only_small):
    router, small = only_small
    asked = len(small.tokenized)
    assert served_by(router, {"text": "y" * 1200}) == "d-small"  # 1208 bytes: counted, 600 tokens
    chat = httpx.post(f"{router}/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 1500}]})
    assert chat.status_code == 200, chat.text
    assert len(small.tokenized) == asked + 2
    assert served_by(router, {"text": "y" * 500}) == "d-small"  # 508 bytes: surely fits, not counted
    assert len(small.tokenized) == asked + 2


def test_a_decode_that_cannot_count_the_prompt_is_a_503_naming_the_field(only_small):
    router, small = only_small
    small.tokenize_status = 500
    try:
        response = httpx.post(f"{router}/generate", json={"text": "y" * 2000})
        assert response.status_code == 503, response.text
        assert response.json()["error"]["param"] == "text"
        assert "the decode could not count the prompt's tokens: fake tokenizer failure" in response.text
        small.tokenize_status = 400
        response = httpx.post(f"{router}/generate", json={"text": "y" * 2000})
        assert response.status_code == 400 and response.json()["error"]["param"] == "text"
    finally:
        small.tokenize_status = 200


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_a_counted_chat_is_rendered_with_the_reasoning_effort_its_pair_is_sent(parser):
    """SGLang renders reasoning_effort into the template (as its thinking switches): the decode counts the prompt as
    the attempt will send it, which is with the effort only where the pair runs a reasoning parser."""
    body = {"messages": [{"role": "user", "content": "y" * 1500}], "reasoning_effort": "none"}
    capabilities = {"capabilities": {"reasoning_parser": parser}}
    small = FakeWorker()
    with discovered({"p": FakeWorker(), "d-small": small}, {"p": "prefill", "d-small": "decode"},
                    extra={"p": LIMITS | capabilities, "d-small": SMALL | capabilities}) as (_, _urls, router):
        answer = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    sent = {"reasoning_effort": "none"} if parser else {}
    assert small.tokenized == [{"messages": body["messages"]} | sent]
    assert {k: v for k, v in small.received[0].items() if k == "reasoning_effort"} == sent
