"""The vocabulary of the inventory: what a decision is, and the value types the bounded and passed fields take.

A `Rule` says what the router does with one field of a request, and why. The types here are pydantic types, strict
(no "5" for 5, no 1.0 for 1, no [true] for true): every value a worker receives has exactly the type SGLang expects,
within limits that SGLang 0.5.23 survives. Limits that depend on the pair serving the request (its vocabulary, its
context length) are named by `pair` and checked once the pair is chosen (router/pd/pairing.py, `check_for_pair`).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StrictBool, StrictInt, StrictStr


class Decision(StrEnum):
    PASSED = "passed"  # sent as given, once its type is checked: the fuzzer shows a worker survives any such value
    BOUNDED = "bounded"  # sent only within limits: static ones here, the pair's vocabulary or context length
    ROUTER = "router"  # the router's own value is sent instead of the client's (see each reason)
    IGNORED = "ignored"  # OpenAI's, not SGLang's: accepted (its type checked) and never sent; the reason says why
    MAPPED = "mapped"  # OpenAI's, which SGLang would drop: sent as the SGLang field of its meaning (the reason says)
    REFUSED = "refused"  # a 400 naming the field and the reason


class PairLimit(StrEnum):
    TOKEN_IDS = "token ids < the pair's vocabulary size"
    TOKENS = "a token count <= the pair's context length"
    POSITION = "a prompt position < the pair's context length"
    # What both workers of the pair must run with (their registered capabilities), else a 400 naming it.
    TOOL_PARSER = "the same tool-call parser on both workers"
    REASONING_PARSER = "one reasoning parser on both workers"
    REASONING_EFFORT = "one reasoning parser on both workers, or none: then not sent"


@dataclass(frozen=True)
class Rule:
    decision: Decision
    reason: str
    type: Any = None  # the pydantic type of its value (PASSED, BOUNDED and ROUTER fields a client may send)
    pair: PairLimit | None = None  # checked against the pair that serves the request
    # A refused field's SGLang default, where it has one (false for most flags, [] for a list): sent as exactly that,
    # the field asks for nothing, so it is taken as not given. Clients that spell out every default (SGLang's own
    # bench_serving sends `"return_routed_experts": false`) are served; any other value is refused.
    # tests/unit/test_inventory.py checks each against SGLang's own default.
    default: bool | int | str | list[str] | None = None

    def __post_init__(self) -> None:
        if (self.type is None) != (self.decision is Decision.REFUSED):
            raise ValueError("a refused field has no type, every other field has one")
        if self.default is not None and self.decision is not Decision.REFUSED:
            raise ValueError("only a refused field declares SGLang's default")

    def asks_nothing(self, value: Any) -> bool:
        """Whether a refused field's value is SGLang's own default (same type: `0` is not `false`)."""
        return self.default is not None and type(value) is type(self.default) and value == self.default


def passed(reason: str, type_: Any, pair: PairLimit | None = None) -> Rule:
    return Rule(Decision.PASSED, reason, type_, pair)


def bounded(reason: str, type_: Any, pair: PairLimit | None = None) -> Rule:
    return Rule(Decision.BOUNDED, reason, type_, pair)


def refused(reason: str, default: bool | int | str | list[str] | None = None) -> Rule:
    return Rule(Decision.REFUSED, reason, default=default)


def router(reason: str, type_: Any) -> Rule:
    return Rule(Decision.ROUTER, reason, type_)


def ignored(reason: str, type_: Any) -> Rule:
    return Rule(Decision.IGNORED, reason, type_)


def mapped(reason: str, type_: Any, pair: PairLimit | None = None) -> Rule:
    return Rule(Decision.MAPPED, reason, type_, pair)


# Static limits. The pair's own limits (vocabulary, context length) come from its registration.
MAX_BATCH = 64  # items of one batch request: each is a request of its own on both workers
MAX_N = 64  # choices of one OpenAI request (`n`): the router's `max_n` bounds it lower (router/openai/fanout.py)
MAX_STOP = 32  # stop strings (SGLang's own MAX_STOP_COUNT)
MAX_STOP_CHARS = 256  # each: SGLang decodes the answer's last tokens this long after every token, for each string
MAX_IDS_LISTED = 256  # stop_token_ids, token_ids_logprob, logit_bias entries
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_GRAMMAR_BYTES = 16 * 1024  # regex, EBNF, JSON schema: compiled by the grammar backend on both workers
MAX_MESSAGES = 1024
MAX_NAME_CHARS = 256  # model, user, a message's name, a tool call's id
MAX_TOOLS = 128  # as OpenAI's: tools of a request, calls of an assistant message
MAX_TOOL_TEXT = 16 * 1024  # a tool's description, a call's arguments (prompt text; their bytes count in its bound)
MAX_STREAM_INTERVAL = 1024
MAX_TEMPERATURE = 100.0  # far above any useful value: sampling is uniform long before
INT32 = 2**31 - 1

Flag = StrictBool


Text = Annotated[StrictStr, Field(min_length=1)]  # SGLang makes an empty prompt of "" with a tokenizer without BOS
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]
Count = Annotated[StrictInt, Field(ge=0, le=INT32)]  # and <= the pair's context length (PairLimit.TOKENS)
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32)]  # and < the pair's vocabulary (PairLimit.TOKEN_IDS)
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_IDS_LISTED)]
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be -1 (the whole vocabulary) or at least 1")
    return value


TopK = Annotated[StrictInt, Field(ge=-1, le=2**30), AfterValidator(_not_zero)]  # SGLang's own ceiling is 2**30
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(ge=0.01, le=2, allow_inf_nan=False)]
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]
LogprobStart = Annotated[StrictInt, Field(ge=-1, le=INT32)]  # -1: output tokens only; < the pair's context length
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)]
# Code points no tokenizer's vocabulary is made of text with: unassigned, private use, surrogates. In a grammar
# (found by the schema fuzzer: a regex with U+7B42D) SGLang's grammar engine came to allow no token at all; greedy
# then emits token 0 and fails the request, sampling draws from NaN probabilities and kills the worker's scheduler.
NO_TEXT_CATEGORIES = ("Cn", "Co", "Cs")


def no_text_code_point(text: str) -> str | None:
    """The first code point of `text` in NO_TEXT_CATEGORIES, as U+XXXX; None if there is none."""
    for char in text:
        if ord(char) > 0x7F and unicodedata.category(char) in NO_TEXT_CATEGORIES:
            return f"U+{ord(char):04X}"
    return None


def _text_only(grammar: str) -> str:
    if (found := no_text_code_point(grammar)) is not None:
        raise ValueError(f"{found} is an unassigned, private-use or surrogate code point: no token is made of it, "
                         "and a grammar that allows no token crashes the worker that samples it")
    return grammar


Grammar = Annotated[StrictStr, Field(min_length=1, max_length=MAX_GRAMMAR_BYTES), AfterValidator(_text_only)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
LogitBias = Annotated[dict[Annotated[StrictStr, Field(pattern=r"^[0-9]{1,10}$")], Bias],
                      Field(max_length=MAX_IDS_LISTED)]
Seed = Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]
StreamInterval = Annotated[StrictInt, Field(ge=1, le=MAX_STREAM_INTERVAL)]
One = Annotated[StrictInt, Field(ge=1, le=1)]  # n, best_of: a PD request is one sample (Literal[1] took true)
Choices = Annotated[StrictInt, Field(ge=1, le=MAX_N)]  # an OpenAI `n`: one PD request per choice
ClientId = StrictStr | list[StrictStr]
