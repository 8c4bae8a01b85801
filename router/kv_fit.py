"""Whether a request's prompt fits a decode's KV pool: the one place where the router decides it.

A decode pre-allocates a request's whole prompt plus `num_reserved_decode_tokens` (SGLang's default: 512) before it
answers the prefill's KV handshake, and SGLang 0.5.23 refuses only prompts longer than the pool: a prompt within the
reserve of the pool's size waits in the decode's queue for room that never comes, until the prefill's bootstrap
timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s by default), and then fails with a 500. A decode whose pool
holds its whole context plus the reserve has no such gap. One with a smaller pool (started on a machine short of RAM,
or a small --max-total-tokens) registers a `prompt_budget` (pdcluster/protocol.py), and pairing gives it only prompts
within it; a prompt no candidate decode can hold is a 400 that names the limit.

Prompts given as token ids are counted exactly. Text is bounded from above by its UTF-8 bytes (byte-level BPE and
SentencePiece with byte fallback never make more tokens than bytes) plus slack for special tokens and a chat
template; only when that bound is over every candidate's budget does a decode count the prompt (SGLang's /tokenize),
so a cluster whose decodes hold their context never pays for it.

The same bytes bound a text from below: every text has a token, except one made only of characters a normalizer may
drop (`may_vanish`); only such a text is counted, and refused at 0 tokens (`refuse_empty_texts`).
"""

from __future__ import annotations

import asyncio
import re
import sys
import unicodedata
from functools import cache

import orjson

from pdcluster.http import ApiError
from router.failures import TRANSPORT_ERRORS
from router.request import Checked, PdRequest
from router.upstream import UpstreamClient
from router.workers import Worker

SPECIAL_TOKENS = 8  # BOS/EOS and the like a tokenizer adds around a text
CHAT_TEMPLATE_TOKENS = 256  # a chat template's own text (some add a default system prompt)
MESSAGE_TOKENS = 16  # a chat template's tokens around each message
COUNT_TIMEOUT = 30.0  # seconds for a decode's /tokenize
# What SGLang's /tokenize reads of a chat request besides messages, so that it renders them as the chat does.
CHAT_KEYS = ("tools", "tool_choice", "reasoning_effort", "continue_final_message", "chat_template_kwargs")
_JSON = {"content-type": "application/json"}


def text_bound(texts: list[str]) -> int:
    """At least the tokens of the longest text."""
    return max(len(text.encode()) for text in texts) + SPECIAL_TOKENS


def chat_bound(texts: list[str], messages: int) -> int:
    """At least the tokens of the rendered conversation."""
    return sum(len(text.encode()) for text in texts) + MESSAGE_TOKENS * messages + CHAT_TEMPLATE_TOKENS


# Characters a tokenizer's normalizer may drop (controls, format characters, unassigned and private-use code points,
# separators, combining marks): a text made only of them can be 0 tokens for a tokenizer that adds no BOS. Bytes
# decide every other text (at least one token); these are counted by the pair's own tokenizer before dispatch.
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


class PromptTooLong(Exception):
    """No candidate decode surely holds the prompt: count it exactly (on `decode`), or refuse it."""

    def __init__(self, decodes: list[Worker]):
        super().__init__("no decode holds the prompt")
        self.decode = max(decodes, key=lambda d: d.prompt_budget or 0)
        self.budget = self.decode.prompt_budget or 0

    def refusal(self, checked: Checked) -> ApiError:
        return ApiError(400, f"{checked.prompt_field} is {checked.longest_prompt} tokens long; the decode workers' KV "
                             f"cache can take prompts of at most {self.budget} tokens (their pools are smaller than "
                             f"the model's context length)", checked.prompt_field)


def holding(decodes: list[Worker], checked: Checked) -> list[Worker]:
    """The decodes that surely hold the prompt; raises PromptTooLong if none does."""
    fit = [d for d in decodes if d.prompt_budget is None or checked.longest_prompt <= d.prompt_budget]
    if not fit and decodes:
        raise PromptTooLong(decodes)
    return fit


async def count_prompt(client: UpstreamClient, decode: Worker, request: PdRequest) -> int:
    """The longest prompt's exact token count, by the decode's own tokenizer and chat template."""
    body = request.body
    if request.route == "/v1/chat/completions":
        ask = {"messages": body["messages"], **{k: body[k] for k in CHAT_KEYS if body.get(k) is not None}}
    else:
        ask = {"prompt": body["text"] if request.route == "/generate" else body["prompt"]}
    count = await _count(client, decode, ask, request.checked.prompt_field,
                         "the prompt may be longer than the decode workers' KV cache can take, and ")
    return max(count) if isinstance(count, list) else count


async def refuse_empty_texts(client: UpstreamClient, decode: Worker, checked: Checked) -> None:
    """A 400 naming the first text prompt the pair's tokenizer makes no token of (validation.may_vanish: only texts
    made of characters a normalizer may drop get here): SGLang 0.5.23's scheduler crashes on a 0-token prefill."""
    params, texts = zip(*checked.may_vanish, strict=True)
    counts = await _count(client, decode, {"prompt": list(texts)}, params[0], "it may have no token, and ")
    for param, count in zip(params, counts if isinstance(counts, list) else [counts], strict=False):
        if count == 0:
            raise ApiError(400, f"{param} has no token for this model's tokenizer: every prompt must have at least "
                                f"one", param)


async def _count(client: UpstreamClient, decode: Worker, ask: dict, field: str, why: str) -> int | list[int]:
    """SGLang's /tokenize on `decode`: the count, or a list of counts for a list of prompts."""
    try:
        async with asyncio.timeout(COUNT_TIMEOUT):
            response = await client.request("POST", decode.url, "/tokenize", orjson.dumps(ask), _JSON)
            answer = orjson.loads(await response.read())
    except (*TRANSPORT_ERRORS, orjson.JSONDecodeError) as exc:
        raise ApiError(503, f"{field}: {why}counting its tokens on {decode.worker_id} failed ({type(exc).__name__})",
                       field) from None
    count = answer.get("count") if isinstance(answer, dict) else None
    if response.status != 200 or not isinstance(count, int | list):
        message = answer.get("message") if isinstance(answer, dict) else None
        raise ApiError(400 if response.status == 400 else 503,
                       f"{field}: the decode could not count the prompt's tokens: {message or response.status}", field)
    return count
