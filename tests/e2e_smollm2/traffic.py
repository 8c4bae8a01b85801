"""The two kinds of request PD is for, as the SmolLM2 tests send them: a short prompt streaming a long answer, and a
long prompt asking for a few tokens. Each returns what went wrong ("" when nothing did), for a test to collect from
its threads."""

from __future__ import annotations

import json
import time

import httpx

from tests.e2e.prompts import prompt_of_about


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
