"""Request checks the router makes before any worker sees a request: the inventory (router/checks/inventory/) applied.

Every field of a body must be in its route's table: a refused or unknown field is a 400 that names it and says why, an
ignored one is type-checked and left out. Each value is checked against its type and static limits (pydantic, strict);
what depends on the serving pair is collected into `Checked` for router/pd/pairing.py's `check_for_pair` (token ids
against its vocabulary, token counts and positions against its context length). SGLang 0.5.23 crashes its scheduler on
many values it does not check, and a crashed scheduler fails every request on that worker. Prompts given as token ids
are only shaped here (router/checks/batches.py; a 30 MiB body costs its JSON parse); their ids are checked per pair.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from pdcluster.common.config_file import field_path
from pdcluster.common.http import ApiError
from router.checks.batches import id_prompts, one_per_item, text_batch
from router.checks.chat_checks import (
    assistant_fields,
    check_tool_use,
    empty_content_not_given,
    response_format_schema,
    translate,
)
from router.checks.checked import (
    CHARS_PER_TOKEN,
    TEMPLATE_TOKENS,
    Checked,
    chat_bound,
    may_vanish,
    text_bound,
    text_tokens,
)
from router.checks.inventory.native import GENERATE, SAMPLING
from router.checks.inventory.openai import CHAT, COMPLETION, MESSAGE
from router.checks.inventory.responses import INPUT_ITEM, RESPONSES
from router.checks.inventory.rules import Decision, PairLimit, Rule
from router.checks.openai_options import prompt_logprobs, stream_options_need_a_stream

LIMITS_DOC = "docs/limits.md"
REQUIRED = frozenset({"messages", "prompt", "role"})  # and a message's content, but in tool calling's (chat_checks.py)
# The Responses API's own: its input; an input item's fields depend on its type (router/checks/responses_checks.py).
REQUIRED_IN = {"responses": frozenset({"input"}), "input item": frozenset()}
# What both workers of the pair must run with (router/checks/chat_checks.py's check_pair_has).
NEEDS = (PairLimit.TOOL_PARSER, PairLimit.REASONING_PARSER, PairLimit.REASONING_EFFORT)
_TABLES = {"generate": GENERATE, "sampling": SAMPLING, "chat": CHAT, "message": MESSAGE, "completion": COMPLETION,
           "responses": RESPONSES, "input item": INPUT_ITEM}


# --- one table applied to one object -------------------------------------------------------------------------------

@cache
def _model(name: str) -> type[BaseModel]:
    table = _TABLES[name]
    required = REQUIRED_IN.get(name, REQUIRED)
    fields: dict[str, Any] = {key: (rule.type, ... if key in required else None)
                              for key, rule in table.items() if rule.decision is not Decision.REFUSED}
    return create_model(name, __config__=ConfigDict(extra="forbid", strict=True), **fields)


def _apply(name: str, body: Any, where: str = "") -> BaseModel:
    """Unknown and refused fields first (each with its reason), then every value's type and static limits.

    A null, and a refused field sent as SGLang's own default, are "not given" and leave the body: clients that spell
    out every field (SGLang's bench_serving sends `"lora_path": null`) are served, and SGLang, which reads some nulls
    as values (500s), never sees one."""
    table = _TABLES[name]
    if not isinstance(body, dict):
        raise ApiError(400, f"{where.rstrip('.') or 'body'} must be a JSON object", where.rstrip(".") or None)
    not_given = []
    for key, value in body.items():
        rule = table.get(key)
        if rule is None:
            raise ApiError(400, f"{where}{key}: unknown field (the fields this router accepts: {LIMITS_DOC})",
                           f"{where}{key}")
        if value is None or (rule.decision is Decision.REFUSED and rule.asks_nothing(value)):
            not_given.append(key)
        elif rule.decision is Decision.REFUSED:
            raise ApiError(400, f"{where}{key} is not accepted: {rule.reason}", f"{where}{key}")
    for key in not_given:
        del body[key]
    try:
        model = _model(name).model_validate(body)
    except ValidationError as exc:
        field, message = _deepest_problem(exc)
        rule = table.get(field.split(".")[0])
        reason = f" ({rule.reason})" if rule is not None and rule.reason else ""
        if field == "body":
            raise ApiError(400, message if not where else f"{where.rstrip('.')}: {message}", where or None) from None
        raise ApiError(400, f"{where}{field}: {message}{reason}", f"{where}{field}") from None
    for key in [key for key in body if table[key].decision is Decision.IGNORED]:
        del body[key]  # accepted, and never sent: SGLang does not know it
    return model


def apply_table(name: str, body: Any, where: str = "") -> BaseModel:
    """One table applied to one object, for the checks of other routes (router/checks/responses_checks.py)."""
    return _apply(name, body, where)


def _deepest_problem(exc: ValidationError) -> tuple[str, str]:
    """(field path, message) of the problem deepest in the value, for a union the member that got furthest: for a
    list of text parts with an image part in it, that part's type, not "should be a string"; for [], "should have
    at least 1 item" (a limit) before "should be a string" (another member's type)."""
    problems = [(field_path(problem.get("loc", ())), problem) for problem in exc.errors()]
    path, problem = max(problems, key=lambda p: (p[0].count(".") + p[0].count("["),
                                                 not str(p[1].get("type", "")).endswith("_type")))
    return path or "body", problem.get("msg", "invalid value").removeprefix("Value error, ")


class _PairChecks:
    """What `check_for_pair` will check, gathered from the accepted values of one request."""

    def __init__(self) -> None:
        self.id_fields: list[tuple[str, list[int]]] = []
        self.counts: list[tuple[str, int, PairLimit]] = []
        self.needs: dict[PairLimit, str] = {}  # each need, by the first field that has it

    def gather(self, table: dict[str, Rule], values: dict[str, Any], where: str = "",
               skip: frozenset[str] = frozenset()) -> None:
        for key, value in values.items():
            rule = table[key]
            if rule.pair is None or value is None or key in skip:
                continue
            if rule.pair in NEEDS:
                if _asks(value):
                    self.needs.setdefault(rule.pair, f"{where}{key}")
            elif rule.pair is PairLimit.TOKEN_IDS:
                ids = [int(k) for k in value] if isinstance(value, dict) else value
                self.id_fields.append((f"{where}{key}", ids))
            else:
                self.counts.append((f"{where}{key}", value, rule.pair))

    def pair_needs(self) -> tuple[tuple[str, PairLimit], ...]:
        return tuple((field, need) for need, field in self.needs.items())


def _asks(value: Any) -> bool:
    """Whether a value asks for what its field needs of the pair: `tools: []`, a flag false (`separate_reasoning`) and
    switches all null (`chat_template_kwargs: {}`) ask for nothing."""
    if value is False or value == []:
        return False
    return any(v is not None for v in value.values()) if isinstance(value, dict) else True


def _client_rid(rid: str | list[str] | None, batch_size: int | None) -> str | None:
    if rid is None:
        return None
    if isinstance(rid, list):
        one_per_item(rid, "rid", batch_size)
        rid = ",".join(rid)
    return rid[:256]


def _vanishing(field: str, value: str | list) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        return ((field, value),) if may_vanish(value) else ()
    return tuple((f"{field}[{i}]", text) for i, text in enumerate(value) if may_vanish(text))


# --- the three routes ------------------------------------------------------------------------------------------------

def check_generate(body: dict[str, Any]) -> Checked:
    _apply("generate", body)
    given = [name for name in ("text", "input_ids") if body.get(name) is not None]
    if len(given) != 1:
        raise ApiError(400, "one of text or input_ids is required" if not given else "give only one of text and "
                            "input_ids", "body")
    checks = _PairChecks()
    checks.gather(GENERATE, body, skip=frozenset({"input_ids"}))
    batch_size, first = None, body.get("text")
    prompts: tuple[list, ...] = ()
    if isinstance(first, list):
        batch_size, first = len(first), first[0]
    elif first is None:
        batch_size, prompts = id_prompts(body["input_ids"], "input_ids")
        first = prompts[0]
    params = body.get("sampling_params")
    if isinstance(params, list):
        if batch_size is None:  # SGLang's HTTP server answers 500 to it
            raise ApiError(400, "sampling_params: a single prompt takes one object (a list is one per batch item)",
                           "sampling_params")
        one_per_item(params, "sampling_params", batch_size)
    for i, p in enumerate(params if isinstance(params, list) else [params] if params is not None else []):
        where = f"sampling_params[{i}]." if isinstance(params, list) else "sampling_params."
        _apply("sampling", p, where)
        checks.gather(SAMPLING, p, where)
    if prompts:
        tokens, longest = sum(map(len, prompts)), max(map(len, prompts))
    else:  # the text was given
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        tokens, longest = text_tokens(texts), text_bound(texts)
    return Checked(batch_size, body.get("stream") is True, first, "input_ids" if prompts else None, prompts,
                   _client_rid(body.get("rid"), batch_size), tuple(checks.id_fields), tuple(checks.counts), tokens,
                   longest, bool(prompts), "input_ids" if prompts else "text",
                   _vanishing("text", body["text"]) if not prompts else (), checks.pair_needs())


def check_completion(body: dict[str, Any]) -> Checked:
    _apply("completion", body)
    stream_options_need_a_stream(body)
    checks = _PairChecks()
    checks.gather(COMPLETION, body, skip=frozenset({"prompt"}))
    response_format_schema(body.get("response_format"))
    prompt, stream, extra = body["prompt"], body.get("stream") is True, (tuple(checks.id_fields), tuple(checks.counts))
    needs, n, echo = checks.pair_needs(), body.get("n") or 1, prompt_logprobs(body)
    if isinstance(prompt, str):
        return Checked(None, stream, prompt, None, (), _client_rid(body.get("rid"), None), *extra,
                       text_tokens([prompt]), text_bound([prompt]), prompt_field="prompt",
                       may_vanish=_vanishing("prompt", prompt), needs=needs, choices=n, prompt_logprobs=echo)
    if isinstance(prompt[0], str):  # a batch of texts (a list of ids or of id lists: below)
        text_batch(prompt, "prompt")
        return Checked(len(prompt), stream, prompt[0], None, (), _client_rid(body.get("rid"), len(prompt)), *extra,
                       text_tokens(prompt), text_bound(prompt), prompt_field="prompt",
                       may_vanish=_vanishing("prompt", prompt), needs=needs, choices=n, prompt_logprobs=echo)
    batch_size, prompts = id_prompts(prompt, "prompt")
    if batch_size is None and not any(prompts[0]):  # SGLang 0.5.23 reads every id false: "Prompt cannot be empty"
        raise ApiError(400, "prompt: a prompt of token ids that are all 0 is taken as empty by SGLang's completions "
                            "(send it to /generate as input_ids)", "prompt")
    return Checked(batch_size, stream, prompts[0], "prompt", prompts, _client_rid(body.get("rid"), batch_size), *extra,
                   sum(map(len, prompts)), max(map(len, prompts)), True, "prompt", needs=needs, choices=n,
                   prompt_logprobs=echo)


def check_chat(body: dict[str, Any]) -> Checked:
    _apply("chat", body)
    stream_options_need_a_stream(body)
    checks = _PairChecks()
    checks.gather(CHAT, body)
    for i, message in enumerate(body["messages"]):
        empty_content_not_given(message)
        _apply("message", message, f"messages[{i}].")
        checks.gather(MESSAGE, message, f"messages[{i}].")
    assistant_fields(body["messages"])
    response_format_schema(body.get("response_format"))
    legacy = translate(body)  # the deprecated functions, function_call: as tools, tool_choice
    tool_bytes = check_tool_use(body, "functions" if legacy else "tools")
    effort = body.pop("reasoning_effort", None)  # sent by each attempt, if its pair parses reasoning (PdRequest)
    rid = body.get("rid")
    if isinstance(rid, list):
        raise ApiError(400, "rid: a chat request takes one id", "rid")
    texts = [part["text"] if isinstance(part, dict) else part for message in body["messages"] if "content" in message
             for part in (message["content"] if isinstance(message["content"], list) else [message["content"]])]
    texts += [message["reasoning_content"] for message in body["messages"] if "reasoning_content" in message]
    return Checked(None, body.get("stream") is True, body["messages"][0].get("content"), client_rid=_client_rid(
        rid, None), id_fields=tuple(checks.id_fields), counts=tuple(checks.counts),
        prompt_tokens=text_tokens(texts) + TEMPLATE_TOKENS * len(body["messages"]) + tool_bytes // CHARS_PER_TOKEN,
        longest_prompt=chat_bound(texts, len(body["messages"])) + tool_bytes, prompt_field="messages",
        needs=checks.pair_needs(), choices=body.get("n") or 1, reasoning_effort=effort, legacy_functions=legacy)

