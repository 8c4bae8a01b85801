"""The two kinds of request PD is for, as the SmolLM2 tests send them: a short prompt streaming a long answer, and a
long prompt asking for a few tokens. Each returns what went wrong ("" when nothing did), for a test to collect from
its threads."""

from __future__ import annotations

import json
import time

import httpx

from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import Reference, assert_matches


def stream_story(router_url: str, i: int, tokens: int, silences: list[float] | None = None) -> str:
    """Stream `tokens` greedy tokens; every answer must be whole (200, its tokens, [DONE], no error event). The time
    between consecutive events goes to `silences`."""
    body = {"text": f"Write a long story about the number {i}.", "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    last, events = time.monotonic(), []
    with httpx.Client(base_url=router_url, timeout=600) as client, client.stream(
            "POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                now = time.monotonic()
                if silences is not None:
                    silences.append(now - last)
                last = now
                events.append(line)
    if response.status_code != 200 or len(events) < 2 or events[-1] != "data: [DONE]" or \
            any('"error"' in e for e in events) or \
            json.loads(events[-2].removeprefix("data: "))["meta_info"]["completion_tokens"] != tokens:
        return f"stream {i}: {response.status_code} {events[-2:]}"
    return ""


def long_prompt(router_url: str, tokenizer, tokens: int) -> str:
    """A prompt of about `tokens` tokens asking for 4: the answer must be whole."""
    body = {"text": prompt_of_about(tokenizer, tokens), "sampling_params": {"max_new_tokens": 4}}
    with httpx.Client(base_url=router_url, timeout=900) as client:
        response = client.post("/generate", json=body)
    if response.status_code != 200 or response.json()["meta_info"]["completion_tokens"] != 4:
        return f"{tokens}-token prompt: {response.status_code} {response.text[:300]}"
    return ""


PAGE = 64  # kv_store's page size: only whole pages are stored


def stored_pages(kv_dir) -> int:
    return sum(1 for _ in kv_dir.rglob("*.bin"))


def store_a_prompt(router: httpx.Client, reference, kv_dir) -> tuple[dict, Reference, dict]:
    """A ~300-token prompt answered once, computed whole, and its whole pages written to the KV store: (the request,
    transformers' reference, the answer)."""
    text = "Notes for the next meeting. " + prompt_of_about(reference.tokenizer, 300)  # no other test's first page
    body = {"text": text, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    ref = reference.greedy(text, 16)
    pages = stored_pages(kv_dir)
    first = router.post("/generate", json=body)
    assert first.status_code == 200, first.text
    assert first.json()["meta_info"]["cached_tokens"] == 0
    whole = (len(ref.prompt_ids) - 1) // PAGE  # whole pages of the prompt (its last token is always computed)
    deadline = time.monotonic() + 60
    while stored_pages(kv_dir) < pages + whole and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stored_pages(kv_dir) >= pages + whole, (pages, stored_pages(kv_dir))
    time.sleep(1)  # a page file is renamed into place once written: let the last one land
    return body, ref, first.json()


def assert_read_from_the_store(router: httpx.Client, reference, stored: tuple[dict, Reference, dict]) -> None:
    """The stored prompt again, after its prefill restarted (its memory empty): its whole pages come from the KV
    store, and the answer is the first one's, token for token, and transformers'."""
    body, ref, first = stored
    again = router.post("/generate", json=body)
    assert again.status_code == 200, again.text
    meta = again.json()["meta_info"]
    whole = (len(ref.prompt_ids) - 1) // PAGE
    storage = int((meta.get("cached_tokens_details") or {}).get("storage") or 0)
    assert meta["cached_tokens"] >= whole * PAGE and storage >= whole * PAGE, meta
    assert again.json()["output_ids"] == first["output_ids"]
    assert_matches(again.json()["output_ids"], ref, reference.eos)
