"""One client request on its way through the router, as nano-vllm's `Sequence` is through its engine: what its checks
found (`Checked`, made by router/validation.py), then the `PdRequest` made once the body is checked
(router/service.py), read by pairing (router/pairing.py) and its attempts (router/attempt.py). Each attempt sets the
fields of the attempt: its number, its rids (the PD fields, below), its start.

Lean on purpose, for it is made for every request: the body is parsed once and kept as the one dict that is sent
(each attempt replaces its PD fields whole, so no copy is needed between attempts), and the prompt is made into
text for a policy only when one asks for it (`hint`).
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import orjson

from router.inventory.rules import PairLimit
from router.workers import Worker

HINT_CHARS = 2048  # how much of a prompt the prefix policy keys on


# --- a text prompt's tokens, without a tokenizer ------------------------------------------------------------------
#
# An estimate, for liveness (prompt_tokens): 1 token per 2 characters over-estimates English and code for BPE
# tokenizers (~4 and ~3 characters a token) and under-estimates CJK (~1), which liveness's margin covers. An upper
# bound, for the decodes' KV pools (longest_prompt; why: router/kv_fit.py): byte-level BPE and SentencePiece with byte
# fallback never make more tokens than UTF-8 bytes, plus special tokens and a chat template. And a lower one, below.

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
    # what a decode's KV pool must hold (router/kv_fit.py).
    longest_prompt: int = 0
    prompt_exact: bool = False
    prompt_field: str = "text"
    # (param, text) of each text prompt made only of characters a tokenizer may drop: counted by the pair's tokenizer
    # before dispatch (router/kv_fit.py's refuse_empty_texts); a 0-token one is refused. Empty for
    # every ordinary request.
    may_vanish: tuple[tuple[str, str], ...] = ()
    # (field, need) of what both workers of the pair must run with (PairLimit.TOOL_PARSER, REASONING_PARSER,
    # DETERMINISTIC): the first field that needs each, named in the 400 of a pair without it.
    needs: tuple[tuple[str, PairLimit], ...] = ()
    choices: int = 1  # an OpenAI request's `n`: more than 1 is a request per choice (router/fanout.py)
    # A chat's reasoning_effort, out of the body: SGLang makes it the template's thinking switches, which only a pair
    # that runs a reasoning parser parses (the same on both: check_for_pair), so each attempt sends it only to such.
    reasoning_effort: str | None = None
    legacy_functions: bool = False  # a chat that gave the deprecated `functions`: answered the legacy way

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


def wants_logprobs(body: dict[str, Any]) -> bool:
    """Whether a native request asked for logprobs (`return_logprob`, one flag or one per batch item): then the
    prefill's input logprobs are merged into the decode's answer (router/logprobs.py), which no other request needs."""
    flag = body.get("return_logprob")
    return any(flag) if isinstance(flag, list) else bool(flag)


class PdRequest:
    __slots__ = ("_hint", "attempt", "attempt_started", "body", "checked", "deadline", "headers", "merge_logprobs",
                 "on_paired", "predicted_cached", "prefer_prefill", "prefill_gate", "prefill_work", "prompt_ids",
                 "request_id",
                 "rids", "route", "started", "timed", "tried")

    def __init__(self, route: str, request_id: str, body: dict[str, Any], checked: Checked, started: float,
                 total_timeout: float):
        self.route, self.request_id, self.body, self.checked = route, request_id, body, checked
        self.started = started  # time.monotonic() when the request came in
        self.deadline = started + total_timeout  # by which the whole answer must be over, streamed or not
        self.merge_logprobs = route == "/generate" and wants_logprobs(body)  # by router/logprobs.py
        self.headers = {"x-request-id": request_id, "content-type": "application/json"}  # sent to both halves
        self.attempt = -1  # the current attempt, from 0
        self.tried: set[str] = set()  # workers that failed this request: the next attempt avoids them
        self.rids: list[str] = []  # the current attempt's, the ids its halves are aborted by
        self.attempt_started = started
        self._hint: str | None = None
        # One choice of several (router/fanout.py): the prefill that will hold the prompt, what to call when an
        # attempt's prefill half is sent (with its prefill, and the half's future), what a prefill half waits for
        # before it is sent, and whether a stream's duration is this request's (a fan-out times its merged stream).
        self.prefer_prefill: str | None = None
        self.on_paired: Callable[[Worker, Any], None] | None = None
        self.prefill_gate: asyncio.Future | None = None
        self.timed = True
        # The cache_aware policy's (router/cache_aware.py): the prompt's token ids from a worker's tokenizer, the
        # cached tokens it predicted on the chosen prefill, which the answer's own count is compared with, and the
        # tokens that prefill will compute (by the ids; else its books take the estimate, `checked.prompt_tokens`).
        self.prompt_ids: list[int] | None = None
        self.predicted_cached: int | None = None
        self.prefill_work: int | None = None

    @property
    def stream(self) -> bool:
        return self.checked.stream

    @property
    def hint(self) -> str:
        """At most HINT_CHARS of the prompt as text, for policies that need the prompt (made once, when asked)."""
        if self._hint is None:
            self._hint = self.checked.hint
        return self._hint

    def start_attempt(self, prefill: Worker) -> None:
        """A new attempt on a pair whose prefill is `prefill`: its PD fields and fresh rids go into the body, and the
        reasoning_effort if the pair parses reasoning."""
        self.attempt += 1
        self.rids = add_pd_fields(self.body, prefill, self.checked.batch_size)
        if (effort := self.reasoning_effort_for(prefill)) is not None:
            self.body["reasoning_effort"] = effort
        else:
            self.body.pop("reasoning_effort", None)
        self.attempt_started = time.monotonic()

    def reasoning_effort_for(self, worker: Worker) -> str | None:
        """The reasoning_effort sent to a pair with `worker` (its two workers run the same reasoning parser:
        check_for_pair): the client's where it runs one, else none (SGLang would make it the thinking switches, which
        nothing there parses: no effect)."""
        return self.checked.reasoning_effort if worker.capabilities.reasoning_parser is not None else None


# --- the PD fields --------------------------------------------------------------------------------------------------
#
# The fields a PD pair needs in every request: where the prefill's KV bootstrap server is, a room number that both
# halves key their transfer state by, and the request ids (rids) the router aborts either half by.
#
# Every rid SGLang sees is made here, fresh for every attempt and every batch item, and all of the same length:
# SGLang aborts every request whose rid *starts with* the given one, so a rid chosen by a client, or one that is a
# prefix of another, could abort other clients' requests. A client's own id is only logged and echoed back.

_ROOM_BITS = 63  # SGLang keys transfers by a non-negative 63-bit room
# Rooms and rids must be unique, not secret (SGLang's own router draws rooms from `random` too); seeded from
# os.urandom per process, without a system call per request as `secrets` and uuid4 make.
_rng = random.Random()


def new_room() -> int:
    return _rng.getrandbits(_ROOM_BITS)


def new_rid() -> str:
    """32 hex digits: fixed length, so no rid is a prefix of another; 128 random bits, so none repeats."""
    return f"{_rng.getrandbits(128):032x}"


def add_pd_fields(body: dict[str, Any], prefill: Worker, batch_size: int | None) -> list[str]:
    """Set SGLang's bootstrap_host/port/room (lists for a batch: one room per item) and fresh rids (replacing any the
    client sent, and those of an earlier attempt); return the rids to abort by."""
    if batch_size is None:
        body["bootstrap_host"] = prefill.kv_bootstrap_host
        body["bootstrap_port"] = prefill.kv_bootstrap_port
        body["bootstrap_room"] = new_room()
        body["rid"] = rid = new_rid()
        return [rid]
    body["bootstrap_host"] = [prefill.kv_bootstrap_host] * batch_size
    body["bootstrap_port"] = [prefill.kv_bootstrap_port] * batch_size
    body["bootstrap_room"] = [new_room() for _ in range(batch_size)]
    body["rid"] = rids = [new_rid() for _ in range(batch_size)]
    return list(rids)
