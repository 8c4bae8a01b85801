"""/v1/completions with `echo` and `logprobs`: the prompt's logprobs under PD, what evaluation harnesses (lm-eval's
local-completions) ask for to score a text. The prefill computed them; the decode's answer has the echoed text and the
completion's logprobs only. The client gets the decode's answer with the prefill's prompt entries put in front of each
choice's logprobs (tokens, token_logprobs, top_logprobs, text_offset; the first prompt token's logprob null), as
SGLang's own server answers without PD. Asked for by router/checks/validation.py (`PromptLogprobs`), merged by the
attempt (router/pd/attempt.py); the text offsets are filled once merged (router/openai/openai_answer.py).

The prefill's answer: per choice, the prompt's entries and then the one token it sampled, which the decode's answer
has too (PREFILL_SAMPLED): measured on SGLang 0.5.23, whole and streamed.
"""

from __future__ import annotations

import json  # logprobs may be -Infinity, which json reads and writes back, orjson not
from typing import Any

from router.checks.checked import PromptLogprobs
from router.pd.logprobs import TextOffsets

PREFILL_SAMPLED = 1  # tokens at the end of the prefill's logprobs that are the completion's, not the prompt's
_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _answers(payload: bytes) -> list[Any]:
    """The prefill's answer: one JSON body, or every `data:` event of its stream."""
    text = payload.decode(errors="replace").strip()
    if not text.startswith("data:"):
        parts = [text]
    else:
        parts = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    answers = []
    for part in parts:
        try:
            answers.append(json.loads(part))
        except json.JSONDecodeError:
            continue
    return answers


def prompt_entries(prefill: bytes) -> dict[int, dict[str, list]]:
    """Each choice's prompt entries (by its index) in the prefill's answer."""
    found: dict[int, dict[str, list]] = {}
    for answer in _answers(prefill):
        for choice in answer.get("choices") or () if isinstance(answer, dict) else ():
            logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
            if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
                continue
            entries = found.setdefault(choice.get("index") or 0, {name: [] for name in _LISTS})
            for name in _LISTS:
                entries[name] += logprobs.get(name) or []
    for entries in found.values():
        prompt = max(0, len(entries["tokens"]) - PREFILL_SAMPLED)
        for name in _LISTS:
            del entries[name][prompt:]
        entries["text_offset"] = [-1] * prompt  # filled once merged
    return found


def _merge_choice(choice: Any, prompt: dict[str, list] | None, asked: PromptLogprobs) -> bool:
    """The prompt's entries put in front of the choice's logprobs, in place; whether it had logprobs to merge."""
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    if prompt is None or not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        return False
    for name in _LISTS:
        logprobs[name] = prompt[name] + (logprobs.get(name) or [])
    if not asked.top:  # `logprobs` 0: SGLang's shape for no top logprobs
        logprobs["top_logprobs"] = []
    return True


def _prompt_only(answer: dict, prompts: dict[int, dict[str, list]]) -> None:
    """`max_tokens` 0: each choice's text, logprobs and usage cut to its prompt (the token sent for it dropped)."""
    for choice in answer.get("choices") or ():
        logprobs, text = choice.get("logprobs"), choice.get("text")
        prompt = len(prompts.get(choice.get("index") or 0, {}).get("tokens", ()))
        if not isinstance(logprobs, dict) or not isinstance(text, str):
            continue
        offsets = TextOffsets().add(text, logprobs["tokens"])
        choice["text"] = text[:offsets[prompt]] if prompt < len(offsets) else text
        for name in _LISTS:
            if isinstance(logprobs.get(name), list):
                del logprobs[name][prompt:]
        choice["finish_reason"] = "length"
        choice.pop("matched_stop", None)
    usage = answer.get("usage")
    if isinstance(usage, dict):
        usage["completion_tokens"] = 0
        usage["total_tokens"] = usage.get("prompt_tokens", 0)


def merge_whole(decode: bytes, prefill: bytes, asked: PromptLogprobs) -> bytes:
    """A whole completions answer with each choice's prompt logprobs put in front."""
    try:
        answer = json.loads(decode)
    except json.JSONDecodeError:
        return decode
    if not isinstance(answer, dict):
        return decode
    prompts = prompt_entries(prefill)
    for choice in answer.get("choices") or ():
        _merge_choice(choice, prompts.get(choice.get("index") or 0) if isinstance(choice, dict) else None, asked)
    if asked.prompt_only:
        _prompt_only(answer, prompts)
    return json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode()


class EchoStream:
    """A completions stream's events with the prompt's logprobs put in front of each choice's first."""

    def __init__(self, prefill: bytes, asked: PromptLogprobs):
        self.prompts, self.asked = prompt_entries(prefill), asked

    def event(self, event: bytes) -> bytes:
        if (not self.prompts and self.asked.top) or not event.startswith(b"data: {") or b'"logprobs"' not in event:
            return event
        try:
            data = json.loads(event[6:])
        except json.JSONDecodeError:
            return event
        for choice in data.get("choices") or () if isinstance(data, dict) else ():
            index = (choice.get("index") or 0) if isinstance(choice, dict) else None
            if index in self.prompts and _merge_choice(choice, self.prompts[index], self.asked):
                del self.prompts[index]
            elif not self.asked.top and isinstance(logprobs := choice.get("logprobs"), dict):
                logprobs["top_logprobs"] = []
        return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
