"""What the checks found out about a request whose fields are all accepted (`Checked`, made by
router/checks/validation.py), and the bounds on a text prompt's tokens they use without a tokenizer. Read by the PD
core (router/pd/) and the policies: a request leaves the checks as a `Checked` or as a 400.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from dataclasses import dataclass
from functools import cache
from typing import Any

import orjson

from router.checks.inventory.rules import PairLimit

HINT_CHARS = 2048  # how much of a prompt the prefix policy keys on


# --- a text prompt's tokens, without a tokenizer ------------------------------------------------------------------
#
# An estimate, for liveness (prompt_tokens): 1 token per 2 characters over-estimates English and code for BPE tokenizers
# (~4 and ~3 characters a token) and under-estimates CJK (~1), which liveness's margin covers. An upper bound, for the
# decodes' KV pools (longest_prompt; why: router/pd/kv_fit.py): byte-level BPE and SentencePiece with byte fallback
# never make more tokens than UTF-8 bytes, plus special tokens and a chat template. And a lower one, below.

CHARS_PER_TOKEN = 2
TEMPLATE_TOKENS = 8  # a chat template's tokens around each message, in the estimate
SPECIAL_TOKENS = 8  # BOS/EOS and the like a tokenizer adds around a text
CHAT_TEMPLATE_TOKENS = 256  # a chat template's own text (some add a default system prompt)
MESSAGE_TOKENS = 16  # a chat template's tokens around each message, in the bound


def text_tokens(texts: list[str]) -> int:
    return sum(len(text) // CHARS_PER_TOKEN + 1 for text in texts)


def text_bound(texts: list[str]) -> int:
    """At least the tokens of the longest text."""
    return max(len(text.encode()) for text in texts) + SPECIAL_TOKENS


def chat_bound(texts: list[str], messages: int) -> int:
    """At least the tokens of the rendered conversation."""
    return sum(len(text.encode()) for text in texts) + MESSAGE_TOKENS * messages + CHAT_TEMPLATE_TOKENS


# Every text has a token, except one made only of characters a tokenizer's normalizer may drop (controls, format
# characters, unassigned and private-use code points, separators, combining marks), which can be 0 tokens for a
# tokenizer that adds no BOS: the pair's own tokenizer counts it before dispatch (kv_fit.py's refuse_empty_texts).
_MAY_VANISH = ("Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp", "Mn", "Me")


def may_vanish(text: str) -> bool:
    rest = text.strip()  # whitespace, in C
    if not rest:
        return True
    if unicodedata.category(rest[0]) not in _MAY_VANISH:  # every ordinary text: decided by its first character
        return False
    return _only_vanishing().fullmatch(rest) is not None  # rare: a regex, so that a long one costs C time, not Python's


@cache
def _only_vanishing() -> re.Pattern[str]:
    """[every code point of _MAY_VANISH]*, built on first need (~0.7 s: it reads the category of every code point)."""
    ranges: list[str] = []
    start = None
    for point in range(sys.maxunicode + 2):
        vanishes = point <= sys.maxunicode and unicodedata.category(chr(point)) in _MAY_VANISH
        if vanishes and start is None:
            start = point
        elif not vanishes and start is not None:
            ranges.append(f"\\U{start:08x}-\\U{point - 1:08x}")
            start = None
    return re.compile(f"[{''.join(ranges)}]*")


@dataclass(frozen=True)
class PromptLogprobs:
    """A completion that echoes its prompt with logprobs (what evaluation harnesses send to score a text): the
    prompt's logprobs are the prefill's, merged into the decode's answer (router/pd/echo.py)."""

    top: bool = True  # top logprobs asked for (`logprobs` > 0); with 0, SGLang computes none of the prompt's: 1 is sent
    prompt_only: bool = False  # `max_tokens` 0: the prompt scored alone (1 is sent, the completion cut off)


@dataclass(frozen=True)
class Checked:
    """What the router needs to know about a request whose fields are all accepted."""

    batch_size: int | None  # None: a single request; N: a batch of N items (SGLang wants lists of rooms)
    stream: bool
    first_prompt: Any  # as given (text, token ids, a chat message's content): what `hint` is made of
    token_ids: str | None = None  # the field holding prompts given as token ids, if any
    prompts: tuple[list, ...] = ()  # those prompts, one list of ids each
    client_rid: str | None = None  # for the logs
    # Checked against the pair: (field, ids) of other token-id fields, (field, value, limit) of counts and positions.
    id_fields: tuple[tuple[str, list[int]], ...] = ()
    counts: tuple[tuple[str, int, PairLimit], ...] = ()
    prompt_tokens: int = 0  # an estimate (the router does not tokenize): how much prefill work this request is
    # The longest prompt's tokens, exact (token ids, or counted by a decode) or an upper bound (text), and its field:
    # what a decode's KV pool must hold (router/pd/kv_fit.py).
    longest_prompt: int = 0
    prompt_exact: bool = False
    prompt_field: str = "text"
    # (param, text) of each text prompt made only of characters a tokenizer may drop: counted by the pair's tokenizer
    # before dispatch (router/pd/kv_fit.py's refuse_empty_texts); a 0-token one is refused. Empty for
    # every ordinary request.
    may_vanish: tuple[tuple[str, str], ...] = ()
    # (field, need) of what both workers of the pair must run with (PairLimit.TOOL_PARSER, REASONING_PARSER,
    # REASONING_EFFORT): the first field that needs each, named in the 400 of a pair without it.
    needs: tuple[tuple[str, PairLimit], ...] = ()
    choices: int = 1  # an OpenAI request's `n`: more than 1 is a request per choice (router/openai/fanout.py)
    # A chat's reasoning_effort, out of the body: SGLang makes it the template's thinking switches, which only a pair
    # that runs a reasoning parser parses (the same on both: check_for_pair), so each attempt sends it only to such.
    reasoning_effort: str | None = None
    legacy_functions: bool = False  # a chat that gave the deprecated `functions`: answered the legacy way
    prompt_logprobs: PromptLogprobs | None = None  # a completion's `echo` with `logprobs`

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
