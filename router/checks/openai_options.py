"""Two OpenAI options whose rules span fields, checked after the inventory (router/checks/validation.py):
`stream_options` only with a stream, as OpenAI answers it; `echo` with `logprobs` (the prompt scored), which SGLang
computes only for some values of the fields it depends on."""

from __future__ import annotations

from typing import Any

from pdcluster.common.http import ApiError
from router.checks.checked import PromptLogprobs


def stream_options_need_a_stream(body: dict[str, Any]) -> None:
    """OpenAI's rule: stream_options only with a stream (its 400 for it)."""
    if "stream_options" in body and body.get("stream") is not True:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")


def prompt_logprobs(body: dict[str, Any]) -> PromptLogprobs | None:
    """`echo` with `logprobs`: the prompt scored (router/pd/echo.py merges the prefill's logprobs of it). SGLang
    computes the prompt's only for `logprobs` > 0 and refuses `max_tokens` 0: 1 is sent for each, and the answer
    made what was asked."""
    max_tokens = body.get("max_tokens")
    if body.get("echo") is not True or body.get("logprobs") is None:
        if max_tokens == 0:
            raise ApiError(400, "max_tokens: at least 1 (0 only with echo and logprobs: the prompt scored alone)",
                           "max_tokens")
        return None
    if max_tokens == 0 and body.get("stream") is True:
        raise ApiError(400, "max_tokens: 0 (the prompt scored alone) is answered whole, not streamed", "max_tokens")
    asked = PromptLogprobs(top=body["logprobs"] > 0, prompt_only=max_tokens == 0)
    body["logprobs"] = max(body["logprobs"], 1)
    if asked.prompt_only:
        body["max_tokens"] = 1
    return asked
