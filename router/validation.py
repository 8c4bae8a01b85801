"""Request checks the router makes before any worker sees a request.

Only what would otherwise make a worker fail late, hang, crash, or answer a 500 is checked here; everything else
passes through untouched (extra fields are allowed), so every option SGLang supports keeps working.

Two stages, because what is valid depends on the model: `check_*` reads the body's shape (cheap: no per-token work,
so a 30 MiB body costs its JSON parse and little more), and `check_token_ids` compares the prompt's token ids with
the vocabulary and context length of the pair chosen to serve it. SGLang 0.5.23 indexes its embedding with a
client's ids without a bounds check: one id out of range crashes the scheduler and takes the worker down.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from pdcluster.http import ApiError, first_validation_problem

# A client's request id is echoed back and logged, never sent to SGLang (which aborts by rid prefix).
CLIENT_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
HINT_CHARS = 2048  # how much of a prompt the prefix policy keys on


def client_request_id(value: str) -> str:
    if not CLIENT_ID.fullmatch(value):
        raise ApiError(400, "X-Request-ID must be 1-128 characters of A-Z a-z 0-9 . _ : @ / + = -", "X-Request-ID")
    return value


class _Passthrough(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


ClientRid = Field(default=None, description="the client's own id: logged, never sent to SGLang")


class SamplingParams(_Passthrough):
    max_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    n: int | None = Field(default=None, ge=1)


class GenerateRequest(_Passthrough):
    text: StrictStr | list[StrictStr] | None = None
    # Shape only (a list, or a list of lists): the ids themselves are checked per pair, see check_token_ids.
    input_ids: list[Any] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = ClientRid

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
        return self


class CompletionRequest(_Passthrough):
    model: StrictStr | None = None
    prompt: StrictStr | list[Any]
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stream: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = ClientRid


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
    rid: StrictStr | None = ClientRid


@dataclass(frozen=True)
class Checked:
    """What the router needs to know about a request whose shape is valid."""

    batch_size: int | None  # None: a single request; N: a batch of N items (SGLang wants lists of rooms)
    stream: bool
    first_prompt: Any  # as given (text, token ids, a chat message's content): what `hint` is made of
    token_ids: str | None = None  # the field holding prompts given as token ids, if any
    prompts: tuple[list, ...] = ()  # those prompts, one list of ids each
    client_rid: str | None = None  # for the logs

    @property
    def hint(self) -> str:
        """At most HINT_CHARS of the first prompt, as text, for prefix-affinity policies. Made on demand: only they
        need it, and a prompt that is not text costs a serialization."""
        prompt = self.first_prompt
        if isinstance(prompt, str):
            return prompt[:HINT_CHARS]
        if self.token_ids is not None:
            return orjson.dumps(prompt[:HINT_CHARS // 4]).decode()[:HINT_CHARS]
        return orjson.dumps(prompt)[:HINT_CHARS].decode(errors="ignore")  # a chat message's content parts


@dataclass(frozen=True)
class ModelLimits:
    """What a pair of workers can take: ids must be < vocab_size, a prompt at most context_length tokens."""

    vocab_size: int | None
    context_length: int | None


def check_token_ids(checked: Checked, limits: ModelLimits) -> None:
    """400 naming the field, the bad id and its position; 503 when the pair's vocabulary is unknown."""
    if not checked.prompts:
        return
    field = checked.token_ids
    if limits.vocab_size is None:
        raise ApiError(503, f"{field}: the serving workers' vocabulary size is unknown, so token ids cannot be "
                            f"checked (static workers need vocab_size in the router config)", field)
    for item, ids in enumerate(checked.prompts):
        where = f"{field}[{item}]" if checked.batch_size is not None else field
        # Length first: it costs nothing, and bounds the per-id work below by the context length.
        if limits.context_length is not None and len(ids) > limits.context_length:
            raise ApiError(400, f"{where} has {len(ids)} tokens; the model's context length is "
                                f"{limits.context_length}", field)
        if set(map(type, ids)) != {int}:  # bool and float are not token ids
            position = next(i for i, t in enumerate(ids) if type(t) is not int)
            raise ApiError(400, f"{where}[{position}] is {orjson.dumps(ids[position]).decode()[:40]}, not a token "
                                f"id (an integer)", field)
        if min(ids) < 0 or max(ids) >= limits.vocab_size:
            position = next(i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size)
            raise ApiError(400, f"{where}[{position}] is {ids[position]}: token ids must be in "
                                f"[0, {limits.vocab_size}) for this model", field)


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


def _client_rid(rid: str | list[str] | None, batch_size: int | None) -> str | None:
    if rid is None:
        return None
    if isinstance(rid, list):
        if len(rid) != (batch_size or 1):
            raise ApiError(400, f"rid has {len(rid)} items for {batch_size or 1} inputs", "rid")
        rid = ",".join(rid)
    return rid[:256]


def _id_prompts(value: list, field: str) -> tuple[int | None, tuple[list, ...]]:
    """(batch size, prompts) of a list of ids or a list of lists of ids; shape errors are 400s."""
    if isinstance(value[0], list):
        for i, ids in enumerate(value):
            if not isinstance(ids, list) or not ids:
                raise ApiError(400, f"{field}[{i}] must be a non-empty list of token ids", field)
        return len(value), tuple(value)
    return None, (value,)


def check_generate(body: dict[str, Any]) -> Checked:
    req = _parse(GenerateRequest, body)
    params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
    for p in params:
        _refuse_parallel_samples(p.n if p else None, "sampling_params.n")
    batch_size, prompts, first = None, (), ""
    if isinstance(req.text, list):
        batch_size, first = len(req.text), req.text[0]
    elif req.text is not None:
        first = req.text
    elif req.input_ids is not None:
        batch_size, prompts = _id_prompts(req.input_ids, "input_ids")
        first = prompts[0]
    if isinstance(req.sampling_params, list) and len(req.sampling_params) != (batch_size or 1):
        raise ApiError(400, f"sampling_params has {len(req.sampling_params)} items for {batch_size or 1} inputs",
                       "sampling_params")
    return Checked(batch_size, req.stream, first, "input_ids" if prompts else None, prompts,
                   _client_rid(req.rid, batch_size))


def check_completion(body: dict[str, Any]) -> Checked:
    req = _parse(CompletionRequest, body)
    _refuse_parallel_samples(req.n, "n")
    prompt = req.prompt
    if isinstance(prompt, str):
        return Checked(None, req.stream, prompt, client_rid=_client_rid(req.rid, None))
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if all(isinstance(p, str) for p in prompt):  # a batch of texts
        return Checked(len(prompt), req.stream, prompt[0], client_rid=_client_rid(req.rid, len(prompt)))
    batch_size, prompts = _id_prompts(prompt, "prompt")
    return Checked(batch_size, req.stream, prompts[0], "prompt", prompts, _client_rid(req.rid, batch_size))


def check_chat(body: dict[str, Any]) -> Checked:
    req = _parse(ChatCompletionRequest, body)
    _refuse_parallel_samples(req.n, "n")
    return Checked(None, req.stream, body["messages"][0].get("content"), client_rid=req.rid)
