"""An OpenAI answer as OpenAI types it, made once the answer is in (router/service.py): every whole answer's
`metadata`, the `text_offset` of /v1/completions' logprobs, whole or streamed (router/pd/logprobs.py fills them), and
the answer to the deprecated `functions` as their clients read it (router/openai/legacy_functions.py), whole or
streamed; the `system_fingerprint` of a seeded request's answer (below); and the usage's reasoning tokens where
OpenAI has them, `completion_tokens_details.reasoning_tokens` (SGLang puts them at the usage's top), whole or streamed.

SGLang puts `metadata: {"weight_version": ..., "weight_versions": [...]}` in every whole chat and completions answer,
where OpenAI's `metadata` is a map of strings: a strictly typed client fails to decode such an answer. The values
stay, as strings (a list as its JSON text). And n choices' answers merged into one (router/openai/fanout.py), whole
or event by event."""

from __future__ import annotations

import json  # as SGLang wrote the answer: logprobs may be -Infinity, which json reads and writes back, orjson not
from collections.abc import AsyncGenerator
from typing import Any

from router.fleet.workers import Worker
from router.openai import legacy_functions
from router.pd import logprobs
from router.transport.edge import Answer, StreamAnswer
from router.transport.upstream_response import sse_events

# The `system_fingerprint` of the answer to a request with a seed: the seed makes the same tokens under any load (both
# workers run SGLang's deterministic inference), or at best effort: the same tokens on an idle cluster, where
# batching does not change the logits (CPU workers sample by the seed: pdcluster/plugins/cpu_seeded_sampling).
DETERMINISTIC, BEST_EFFORT = "pdcluster-deterministic", "pdcluster-best-effort"


def seed_fingerprint(body: dict[str, Any], prefill: Worker, decode: Worker) -> str | None:
    """The fingerprint of a seeded request's answer from the pair; None without a seed."""
    if body.get("seed") is None:
        return None
    deterministic = prefill.capabilities.deterministic_inference and decode.capabilities.deterministic_inference
    return DETERMINISTIC if deterministic else BEST_EFFORT


def shaped(answer: Answer | StreamAnswer, route: str, body: dict[str, Any],
           legacy: bool = False, fingerprint: str | None = None) -> Answer | StreamAnswer:
    """The answer of an OpenAI route (`body`: the request's; `legacy`: a chat that gave `functions`; `fingerprint`: a
    seeded one's) as the client gets it."""
    offsets = route == "/v1/completions" and body.get("logprobs") is not None
    if isinstance(answer, StreamAnswer):
        answer.chunks = _stream_usage(answer.chunks)
        if offsets:
            answer.chunks = logprobs.stream_text_offsets(answer.chunks)
        if legacy:
            answer.chunks = legacy_functions.stream(answer.chunks)
        if fingerprint is not None:
            answer.chunks = _stream_fingerprint(answer.chunks, fingerprint)
    elif offsets or legacy or fingerprint is not None or b'"metadata"' in answer.body or b'"usage"' in answer.body:
        answer.body = whole(answer.body, offsets, legacy, fingerprint)
    return answer


def reasoning_in_details(data: Any) -> bool:
    """The usage's `reasoning_tokens` moved under its `completion_tokens_details`, in place; whether there were any."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict) or "reasoning_tokens" not in usage:
        return False
    details = usage.get("completion_tokens_details")
    usage["completion_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                          "reasoning_tokens": number(usage.pop("reasoning_tokens"))}
    return True


async def _stream_usage(chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """A stream with its usage's reasoning tokens where OpenAI has them. Only a chunk that names them is parsed (a
    usage event, held until it is whole); every other passes as it came."""
    pending = b""
    try:
        async for chunk in chunks:
            if not pending and b'"reasoning_tokens"' not in chunk:
                yield chunk
                continue
            pending += chunk
            if pending.endswith(b"\n\n"):
                yield b"".join(_usage_event(event) for event in pending.split(b"\n\n")[:-1])
                pending = b""
        if pending:
            yield pending
    finally:  # closed early (the client left): the relay below runs its own clean-up
        await chunks.aclose()


def _usage_event(event: bytes) -> bytes:
    if event.startswith(b"data: {") and b'"reasoning_tokens"' in event:
        try:
            data = json.loads(event[6:])
        except ValueError:
            data = None
        if reasoning_in_details(data):
            event = b"data: " + dumps(data)
    return event + b"\n\n"


async def _stream_fingerprint(chunks: AsyncGenerator[bytes, None], fingerprint: str) -> AsyncGenerator[bytes, None]:
    """A stream with `fingerprint` in each event of the answer (an error event left as it is)."""
    field = b'data: {"system_fingerprint":' + json.dumps(fingerprint).encode() + b","
    events = sse_events(chunks)
    try:
        async for event in events:
            if event.startswith(b"data: {") and not event.startswith(b'data: {"error"'):
                event = field + event[7:]
            yield event
    finally:  # closed early (the client left): the relay below runs its own clean-up
        await events.aclose()
        await chunks.aclose()


def typed_metadata(payload: bytes) -> bytes:
    """The whole answer with its top-level `metadata` values made strings; any other answer unchanged."""
    return whole(payload, offsets=False)


def whole(payload: bytes, offsets: bool, legacy: bool = False, fingerprint: str | None = None) -> bytes:
    """A whole answer with its metadata typed, (`offsets`) its text offsets filled, (`legacy`) its calls written
    the legacy way and its `fingerprint`; unchanged, the same bytes."""
    try:
        answer: Any = json.loads(payload)
    except ValueError:
        return payload
    changed = offsets and logprobs.fill_text_offsets(answer, {})
    changed = (legacy and legacy_functions.whole(answer)) or changed
    changed = reasoning_in_details(answer) or changed
    if fingerprint is not None and isinstance(answer, dict) and "choices" in answer:
        answer["system_fingerprint"] = fingerprint
        changed = True
    metadata = answer.get("metadata") if isinstance(answer, dict) else None
    if isinstance(metadata, dict) and not all(isinstance(v, str) for v in metadata.values()):
        answer["metadata"] = {str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
                              for k, v in metadata.items()}
        changed = True
    return json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode() if changed else payload


def number(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def merged_usage(usages: list[dict]) -> dict:
    """The usage of n choices: the prompt once (the first's count and details: they share the prompt), the
    completions of all; total = prompt + completions, as OpenAI counts them."""
    merged = dict(usages[0])
    completion = sum(number(u.get("completion_tokens")) for u in usages)
    merged["completion_tokens"] = completion
    merged["total_tokens"] = number(merged.get("prompt_tokens")) + completion
    if any(number(u.get("reasoning_tokens")) for u in usages):
        merged["reasoning_tokens"] = sum(number(u.get("reasoning_tokens")) for u in usages)
    details = [d for u in usages if isinstance(d := u.get("completion_tokens_details"), dict)]
    if details:
        merged["completion_tokens_details"] = {key: sum(number(d.get(key)) for d in details)
                                               for key in dict.fromkeys(k for d in details for k in d)}
    return merged


def merged_answer(payloads: list[bytes], n: int, answer_id: str) -> bytes:
    """Whole answers of n choices (each answer a choice, or k for k prompts) as one: the first's, with every choice
    indexed, `answer_id` and the usage merged."""
    answers = [json.loads(payload) for payload in payloads]
    choices = []
    for index, answer in enumerate(answers):
        for choice in answer["choices"]:
            choice["index"] = number(choice.get("index")) * n + index
            choices.append(choice)
    merged = answers[0]
    merged["id"], merged["choices"] = answer_id, sorted(choices, key=lambda choice: choice["index"])
    if all(isinstance(answer.get("usage"), dict) for answer in answers):
        merged["usage"] = merged_usage([answer["usage"] for answer in answers])
    return dumps(merged)


def merged_event(event: bytes, index: int, n: int, answer_id: str, created: int,
                 usages: dict[int, tuple[dict, dict]]) -> bytes | None:
    """Choice `index`'s streamed event as the client gets it in the merged stream of n choices (`answer_id`,
    `created`); None: none (its [DONE]; its usage, kept in `usages` for the end)."""
    if not event.startswith(b"data: {"):
        return None if event.startswith(b"data: [DONE]") else event
    try:
        data = json.loads(event[6:])
    except ValueError:
        return event
    if not isinstance(data, dict) or not isinstance(choices := data.get("choices"), list):
        return event  # an error event (the router's shape already), or what no choice is part of
    if not choices:
        if isinstance(data.get("usage"), dict):
            usages[index] = (data, data["usage"])
            return None
        if index:  # the answer's extras (sglext: the prompt's cache details): the first choice's only
            return None
    for choice in choices:
        if isinstance(choice, dict):
            choice["index"] = number(choice.get("index")) * n + index
    data["id"], data["created"] = answer_id, created
    return b"data: " + dumps(data) + b"\n\n"
