"""A decode-only worker answers on fake KV, without any prefill, with exactly the tokens asked for."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.cluster.decode_only import fake_kv


@pytest.mark.parametrize("max_new", [1, 24])
def test_answers_with_the_tokens_asked_for(client, max_new):
    answer = client.post("/generate", json={
        "text": "The decode never sees this prompt's KV", **fake_kv(room=max_new),
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert len(body["output_ids"]) == max_new
    assert body["meta_info"]["completion_tokens"] == max_new
    assert body["meta_info"]["finish_reason"]["type"] == "length"


def test_concurrent_long_prompts_stream_every_token(client):
    """Requests decoded in one batch, with prompts of hundreds of tokens whose KV was never written: the decode
    still steps through every one of them (what the decode-only benchmark loads it with)."""
    lengths = (300, 200, 100, 50)

    def stream(n: int) -> dict:
        last = {}
        with client.stream("POST", "/generate", json={
                "input_ids": list(range(10, 10 + n)), "stream": True, **fake_kv(room=1000 + n),
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[len("data: "):])
        return last

    with ThreadPoolExecutor(len(lengths)) as pool:
        finals = list(pool.map(stream, lengths))
    assert [f["meta_info"]["prompt_tokens"] for f in finals] == list(lengths)
    assert [f["meta_info"]["completion_tokens"] for f in finals] == [16] * len(lengths)
