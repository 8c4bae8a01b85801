"""Request checks the router makes before any worker sees a request.

Only what would otherwise make a worker fail late, hang, or answer a 500 is checked here; everything else passes
through untouched (extra fields are allowed), so every option SGLang supports keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from pdcluster.http import ApiError, first_validation_problem


class _Passthrough(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class SamplingParams(_Passthrough):
    max_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    n: int | None = Field(default=None, ge=1)


class GenerateRequest(_Passthrough):
    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        # input_embeds is an extra field; model_extra, not getattr (a missing extra raises inside pydantic, slowly)
        inputs_given = (self.text, self.input_ids, (self.model_extra or {}).get("input_embeds"))
        given = [name for name, value in zip(("text", "input_ids", "input_embeds"), inputs_given) if value is not None]
        if not given:
            raise ValueError("one of text or input_ids is required")
        if len(given) > 1:
            raise ValueError(f"give only one of {' and '.join(given)}")
        inputs = self.text if self.text is not None else self.input_ids
        if isinstance(inputs, list) and len(inputs) == 0:
            raise ValueError(f"{given[0]} is empty")
        if isinstance(self.input_ids, list) and any(isinstance(i, list) and not i for i in self.input_ids):
            raise ValueError("input_ids has an empty sequence")
        return self


class CompletionRequest(_Passthrough):
    model: StrictStr | None = None
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stream: StrictBool = False


class ChatMessage(_Passthrough):
    role: StrictStr


class ChatCompletionRequest(_Passthrough):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stream: StrictBool = False


@dataclass(frozen=True)
class Checked:
    """What the router needs to know about a valid request."""

    batch_size: int | None  # None: a single request; N: a batch of N items (SGLang wants lists of rooms)
    stream: bool
    prompt: str  # for prefix-affinity policies


def _parse(model: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        field, message = first_validation_problem(exc)
        message = message.removeprefix("Value error, ")
        raise ApiError(400, message if field == "body" else f"{field}: {message}", field) from None


def _refuse_parallel_samples(n: int | None, field: str) -> None:
    if n is not None and n > 1:
        raise ApiError(400, f"{field}: n > 1 is not supported through the PD router; send n separate requests",
                       field)


def check_generate(body: dict[str, Any]) -> Checked:
    req = _parse(GenerateRequest, body)
    params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
    for p in params:
        _refuse_parallel_samples(p.n if p else None, "sampling_params.n")
    batch_size = None
    if isinstance(req.text, list):
        batch_size = len(req.text)
    elif req.input_ids and isinstance(req.input_ids[0], list):
        batch_size = len(req.input_ids)
    if isinstance(req.sampling_params, list) and len(req.sampling_params) != (batch_size or 1):
        raise ApiError(400, f"sampling_params has {len(req.sampling_params)} items for {batch_size or 1} inputs",
                       "sampling_params")
    if isinstance(req.rid, list) and len(req.rid) != (batch_size or 1):
        raise ApiError(400, f"rid has {len(req.rid)} items for {batch_size or 1} inputs", "rid")
    prompt = req.text if isinstance(req.text, str) else str(req.input_ids or req.text)
    return Checked(batch_size, req.stream, prompt)


def check_completion(body: dict[str, Any]) -> Checked:
    req = _parse(CompletionRequest, body)
    _refuse_parallel_samples(req.n, "n")
    prompt = req.prompt
    batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    return Checked(len(prompt) if batch else None, req.stream, prompt if isinstance(prompt, str) else str(prompt))


def check_chat(body: dict[str, Any]) -> Checked:
    req = _parse(ChatCompletionRequest, body)
    _refuse_parallel_samples(req.n, "n")
    return Checked(None, req.stream, str(body["messages"]))
