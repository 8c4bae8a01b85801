"""A whole OpenAI answer as OpenAI types it: SGLang's `metadata` (weight versions, a list among them) becomes a map
of strings, as OpenAI's `metadata` is, so that a strictly typed client decodes it; nothing else changes."""

from __future__ import annotations

import json

import httpx

from router.openai.openai_answer import typed_metadata
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_router_pd import cluster

SGLANG_METADATA = {"weight_version": "default", "weight_versions": ["default", "v2"]}


def test_metadata_values_become_strings_and_the_rest_stays():
    answer = {"id": "a", "choices": [{"logprobs": {"content": [{"logprob": float("-inf")}]}}],
              "metadata": SGLANG_METADATA}
    typed = json.loads(typed_metadata(json.dumps(answer).encode()))
    assert typed["metadata"] == {"weight_version": "default", "weight_versions": '["default","v2"]'}
    assert typed["choices"] == answer["choices"]  # -Infinity survives, as SGLang wrote it


def test_answers_without_such_metadata_are_left_byte_for_byte():
    for payload in (b'{"metadata": {"a": "b"}}', b'{"id": 1}', b"[1]", b"not json", b'{"metadata": null}'):
        assert typed_metadata(payload) is payload


def test_chat_and_completions_answers_through_the_router_carry_string_metadata():
    decode = FakeWorker(Behaviour(answer_fields={"metadata": SGLANG_METADATA}))
    with cluster(FakeWorker(), decode) as url:
        for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/completions", {"prompt": "hi"})):
            answer = httpx.post(f"{url}{route}", json=body).json()
            assert all(isinstance(v, str) for v in answer["metadata"].values()), answer
        generated = httpx.post(f"{url}/generate", json={"text": "hi"}).json()
    assert generated["metadata"] == SGLANG_METADATA  # the native API is SGLang's own: left as it is


def test_reasoning_tokens_are_where_openai_has_them_whole_and_streamed():
    """SGLang puts `reasoning_tokens` at the usage's top; OpenAI's clients read usage.completion_tokens_details."""
    decode = FakeWorker(Behaviour(chunks=2))
    with cluster(FakeWorker(), decode) as url:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        whole = httpx.post(f"{url}/v1/chat/completions", json=body).json()
        streamed = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True, "stream_options": {
            "include_usage": True}})
        merged = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "n": 2}).json()
    usages = [whole["usage"], merged["usage"]] + [json.loads(line[6:])["usage"] for line in streamed.text.splitlines()
                                                  if line.startswith("data: {") and '"usage"' in line]
    assert len(usages) == 3
    for usage in usages:
        assert "reasoning_tokens" not in usage and usage["completion_tokens_details"] == {"reasoning_tokens": 0}
