"""Whether a request's prompt fits a decode's KV pool, and what the router does when its bounds cannot tell.

A decode pre-allocates a request's whole prompt plus `num_reserved_decode_tokens` (SGLang's default: 512) before it
answers the prefill's KV handshake, and SGLang 0.5.23 refuses only prompts longer than the pool: a prompt within the
reserve of the pool's size waits in the decode's queue for room that never comes, until the prefill's bootstrap
timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s by default), and then fails with a 500. A decode whose pool
holds its whole context plus the reserve has no such gap. One with a smaller pool (started on a machine short of RAM,
or a small --max-total-tokens) registers a `prompt_budget` (pdcluster/common/protocol.py), and pairing gives it only
prompts within it; a prompt no candidate decode can hold is a 400 that names the limit.

Prompts given as token ids are counted exactly. Text is bounded from above by its UTF-8 bytes
(router/checks/validation.py's
`text_bound`: byte-level BPE and SentencePiece with byte fallback never make more tokens than bytes) plus slack for
special tokens and a chat template; pairing keeps the decodes whose budget holds that (router/pd/pairing.py's
`holding`).
Only when the bound is over every candidate's budget (PromptTooLong) does a decode count the prompt (`count_prompt`,
SGLang's /tokenize), so a cluster whose decodes hold their context never pays for it.

The same bytes bound a text from below: every text has a token, except one made only of characters a normalizer may
drop (request.py's `may_vanish`); only such a text is counted, and refused at 0 tokens (`refuse_empty_texts`).
"""

from __future__ import annotations

import asyncio

import orjson

from pdcluster.common.http import ApiError
from router.checks.checked import Checked
from router.fleet.workers import Worker
from router.kv_routing.prompt_ids import CHAT_KEYS
from router.pd.failures import TRANSPORT_ERRORS
from router.pd.request import PdRequest
from router.transport.upstream import UpstreamClient

COUNT_TIMEOUT = 30.0  # seconds for a decode's /tokenize
_JSON = {"content-type": "application/json"}


async def count_prompt(client: UpstreamClient, decode: Worker, request: PdRequest) -> int:
    """The longest prompt's exact token count, by the decode's own tokenizer and chat template."""
    body = request.body
    if request.route == "/v1/chat/completions":
        ask = {"messages": body["messages"], **{k: body[k] for k in CHAT_KEYS if body.get(k) is not None}}
        if (effort := request.reasoning_effort_for(decode)) is not None:  # as the attempt will send it
            ask["reasoning_effort"] = effort
    else:
        ask = {"prompt": body["text"] if request.route == "/generate" else body["prompt"]}
    count = await _count(client, decode, ask, request.checked.prompt_field,
                         "the prompt may be longer than the decode workers' KV cache can take, and ")
    return max(count) if isinstance(count, list) else count


async def refuse_empty_texts(client: UpstreamClient, decode: Worker, checked: Checked) -> None:
    """A 400 naming the first text prompt the pair's tokenizer makes no token of (request.may_vanish: only texts
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
