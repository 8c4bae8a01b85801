"""The inventory names every field of SGLang's request types, and docs/limits.md is what it says.

When SGLang is upgraded and a request type gains or loses a field, these tests fail with the difference: the new
field is refused by the router (unknown) until someone decides it in router/checks/inventory/."""

from __future__ import annotations

import dataclasses
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionMessage, completion_create_params
from openai.types.responses import response_create_params
from sglang.srt.entrypoints.openai import protocol
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams

from router.checks.inventory import CHAT, COMPLETION, GENERATE, INPUT_ITEM, MESSAGE, RESPONSES, SAMPLING, Decision
from router.checks.inventory.__main__ import render

REPO = Path(__file__).resolve().parents[2]


def message_fields() -> set[str]:
    return set(protocol.ChatCompletionMessageGenericParam.model_fields) | set(
        protocol.ChatCompletionMessageUserParam.model_fields)


def _pydantic_defaults(*models) -> dict:
    return {name: field.default for model in models for name, field in model.model_fields.items()}


SGLANG_DEFAULTS = [
    pytest.param(GENERATE, {f.name: f.default for f in dataclasses.fields(GenerateReqInput)}, id="GenerateReqInput"),
    pytest.param(SAMPLING, dict(zip(SamplingParams.__struct_fields__[-len(SamplingParams.__struct_defaults__):],
                                    SamplingParams.__struct_defaults__, strict=True)), id="SamplingParams"),
    pytest.param(CHAT, _pydantic_defaults(protocol.ChatCompletionRequest), id="ChatCompletionRequest"),
    pytest.param(COMPLETION, _pydantic_defaults(protocol.CompletionRequest), id="CompletionRequest"),
    pytest.param(MESSAGE, _pydantic_defaults(protocol.ChatCompletionMessageGenericParam,
                                             protocol.ChatCompletionMessageUserParam), id="chat message"),
]


@pytest.mark.parametrize(("table", "defaults"), SGLANG_DEFAULTS)
def test_a_refused_field_sent_as_sglang_default_is_taken_as_not_given(table, defaults):
    """Each refused field declares SGLang's default where it has a plain one (false, 0, "auto"), so that a client
    spelling it out is served; a changed default in SGLang fails here, not in a client's face."""
    declared = {name: rule.default for name, rule in table.items() if rule.decision is Decision.REFUSED}
    plain = {name: defaults.get(name) if isinstance(defaults.get(name), bool | int | str) else None
             for name in declared}
    assert declared == plain


def openai_fields(*types) -> set[str]:
    return {name for t in types for name in getattr(t, "model_fields", None) or t.__annotations__}


# OpenAI's own fields, which SGLang's types do not have (the official client's types, in SGLang's environment).
OPENAI_REQUEST = openai_fields(completion_create_params.CompletionCreateParamsBase)
OPENAI_MESSAGE = openai_fields(ChatCompletionMessage, ChatCompletionAssistantMessageParam)


@pytest.mark.parametrize(("table", "sglang_fields", "openai"), [
    pytest.param(GENERATE, {f.name for f in dataclasses.fields(GenerateReqInput)}, set(), id="GenerateReqInput"),
    pytest.param(SAMPLING, set(SamplingParams.__struct_fields__), set(), id="SamplingParams"),
    pytest.param(CHAT, set(protocol.ChatCompletionRequest.model_fields), OPENAI_REQUEST, id="ChatCompletionRequest"),
    pytest.param(COMPLETION, set(protocol.CompletionRequest.model_fields), set(), id="CompletionRequest"),
    pytest.param(MESSAGE, message_fields(), OPENAI_MESSAGE, id="chat message"),
])
def test_every_field_of_sglang_is_decided_and_nothing_else(table, sglang_fields, openai):
    """Nothing else but the OpenAI fields SGLang does not know: accepted and never sent, sent as SGLang's field of
    their meaning, or refused (an ignored or mapped field that SGLang knew would be a feature silently changed)."""
    own = {name for name, rule in table.items() if rule.decision in (Decision.IGNORED, Decision.MAPPED)}
    assert not own & sglang_fields, f"SGLang reads these: decide them, not ignore or map: {own & sglang_fields}"
    assert own <= openai, f"not OpenAI's: {own - openai}"
    table = {name: rule for name, rule in table.items() if name not in own}
    openai_refused = {name for name, rule in table.items() if rule.decision is Decision.REFUSED} & openai
    assert {"undecided (new in SGLang?)": sorted(sglang_fields - set(table)),
            "decided but gone from SGLang": sorted(set(table) - sglang_fields - openai_refused)} == {
        "undecided (new in SGLang?)": [], "decided but gone from SGLang": []}


def test_the_responses_table_is_exactly_the_official_clients_request():
    """Every field of openai's ResponseCreateParams (and `stream`) decided, and no other: the Responses API is OpenAI's
    alone (the router serves it as a chat, router/openai/responses_render.py)."""
    fields = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert set(RESPONSES) == fields
    assert {"type", "role", "content", "call_id", "name", "arguments", "output"} <= set(INPUT_ITEM)


def test_every_refusal_says_why():
    for table in (GENERATE, SAMPLING, CHAT, COMPLETION, MESSAGE, RESPONSES, INPUT_ITEM):
        for name, rule in table.items():
            assert rule.decision is not Decision.REFUSED or len(rule.reason) > 10, name


def test_docs_limits_is_generated_from_the_inventory():
    generated = render(version("sglang"))
    assert (REPO / "docs" / "limits.md").read_text() == generated, (
        "docs/limits.md is stale: run `python -m router.checks.inventory > docs/limits.md`")


def test_the_errors_doc_names_only_fields_the_inventory_decides():
    doc = (REPO / "docs" / "errors.md").read_text()
    section = doc[doc.index("# Errors and limits"):doc.index("**Request ids.**")]
    known = set().union(GENERATE, SAMPLING, CHAT, COMPLETION, MESSAGE)
    settings = {"max_body_bytes", "vocab_size", "first_token_timeout", "total_timeout", "read_timeout", "null",
                "max_n"}
    named = {word for word in re.findall(r"`([a-z_]+)`", section)} - settings
    assert named <= known, f"docs/errors.md names fields no table decides: {sorted(named - known)}"
    assert "limits.md" in section
