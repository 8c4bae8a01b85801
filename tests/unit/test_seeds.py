"""A seed never breaks a client: `seed` and `sampling_seed` are sent on through any pair, and a seeded OpenAI answer's
system_fingerprint says whether the seed makes it deterministic (both workers run SGLang's deterministic inference)
or best effort (router/openai/openai_answer.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from router.openai.openai_answer import BEST_EFFORT, DETERMINISTIC
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_pair_needs import router

CHAT = {"messages": [{"role": "user", "content": "hi"}], "seed": 7}


def fingerprints(answer: httpx.Response) -> list[str | None]:
    if not answer.headers["content-type"].startswith("text/event-stream"):
        return [answer.json().get("system_fingerprint")]
    return [json.loads(line[6:]).get("system_fingerprint") for line in answer.text.splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize(("deterministic", "fingerprint"), [(True, DETERMINISTIC), (False, BEST_EFFORT)])
def test_a_seeded_answer_says_how_the_seed_is_honoured(deterministic, fingerprint):
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=2))
    with router(prefill, decode, deterministic_inference=deterministic) as url:
        answers = [httpx.post(f"{url}{path}", json={**body, **extra}, timeout=30)
                   for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "a", "seed": 0})]
                   for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}, {"n": 2})]
        native = httpx.post(f"{url}/generate", json={"text": "a", "sampling_params": {"sampling_seed": 3}}, timeout=30)
        unseeded = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "seed": None}, timeout=30)
    assert [answer.status_code for answer in answers] == [200] * 6
    assert all(set(fingerprints(answer)) == {fingerprint} for answer in answers)
    assert len(fingerprints(answers[1])) == 3  # each event of the stream: two tokens and the usage
    assert native.status_code == 200 and "system_fingerprint" not in native.json()
    assert decode.received[-2]["sampling_params"] == {"sampling_seed": 3}
    assert unseeded.status_code == 200 and "system_fingerprint" not in unseeded.json()
