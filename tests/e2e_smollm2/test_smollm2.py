"""SmolLM2-135M-Instruct through the PD cluster, as `make up` serves it: greedy tokens equal to transformers' (plain
and streamed), and a chat answer through the model's own chat template. A trained model: the answers are also checked
for what a person would read. (A prompt's KV read back from the KV store after the workers restart: test_pinned.py,
whose restart it shares.)"""

from __future__ import annotations

import json

import pytest

from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import assert_matches

MODEL = "smollm2-135m-instruct"
MAX_NEW = 16
PROMPTS = {
    "france": "The capital of France is",
    "colors": "The three primary colors are",
    # ~300 tokens: several KV pages, and one prefill forward of well under a second on 2 cores
    "paragraphs": None,
}


def greedy(text: str | list[int], max_new: int = MAX_NEW, **extra) -> dict:
    prompt = {"text": text} if isinstance(text, str) else {"input_ids": text}
    return {**prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, **extra}


def prompt(reference, name: str) -> str:
    return PROMPTS[name] or prompt_of_about(reference.tokenizer, 300)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_generate_equals_transformers(router, reference, name):
    text = prompt(reference, name)
    ref = reference.greedy(text, MAX_NEW)
    response = router.post("/generate", json=greedy(text))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)
    assert_matches(answer["output_ids"], ref, reference.eos)
    if name == "france":
        assert answer["text"].startswith(" Paris."), answer["text"]


@pytest.mark.parametrize("name", ["colors", "paragraphs"])
def test_streamed_generate_equals_transformers(router, reference, name):
    text = prompt(reference, name)
    ref = reference.greedy(text, MAX_NEW)
    with router.stream("POST", "/generate", json=greedy(text, stream=True)) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2, events[-3:]  # streamed as generated, not in one piece
    last = json.loads(events[-2])
    assert_matches(last["output_ids"], ref, reference.eos)
    assert last["text"] == reference.tokenizer.decode(last["output_ids"])


def test_chat_answers_through_the_models_chat_template(router, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = router.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 32,
                                                         "temperature": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"  # the model's own <|im_end|>, long before max_tokens
    # Exactly transformers' greedy answer to the same chat template (SmolLM2's ChatML, its default system prompt).
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = reference.greedy_ids(ids, 32)
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
    assert choice["message"]["content"] == reference.tokenizer.decode(ref.ids, skip_special_tokens=True)
