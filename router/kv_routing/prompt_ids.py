"""A request's leading token ids, as the engine makes them, for the cache_aware policy
(router/kv_routing/cache_aware.py), from what the policy's view of the request holds (router/routing/policy.py's
RoutingView).

The router does not otherwise tokenize (router/checks/checked.py estimates; router/pd/kv_fit.py asks a decode's
/tokenize only when a bound cannot decide, a round trip per request). Here the cheapest correct path is taken:
- prompts given as token ids (`input_ids`, a completion's `prompt` of ids): those, as they are;
- a text prompt (`/generate`'s `text`, a completion's `prompt`): the model's own `tokenizer.json`, loaded with the
  `tokenizers` library (Rust; what SGLang's fast tokenizer runs) from the model folder the prefills registered, if
  this router can read it (`make up`, the tests, the CPU image's built-in models).
  SGLang encodes a text with its special tokens (`tokenizer.encode(text)`), and so does this. Only the first
  MAX_CHARS characters are encoded, less the last tokens, which a longer text may merge differently: prefix matching
  needs no more, and the cost stays bounded; and of those, by pieces (router/kv_routing/token_pieces.py), only as far
  as a walk of the KV index reads (`lazy`);
- a chat: its messages rendered by the model's chat template as SGLang renders them
  (router/kv_routing/chat_template.py), then encoded as a text is, but with no special tokens added (the template
  writes its own), and the text of a final assistant message it continues after them. A chat the renderer does not
  follow: None, routed by its text.
A tokenizer and template are loaded off the event loop (`load`, when a prefill is first subscribed); until then: None.
A model whose folder this router cannot read (a hub id the workers downloaded: compose, Kubernetes) is `remote`:
its prompts' ids (and a chat's where no template loads) are what a worker's SGLang /tokenize answers (`ask`: the same
cut of a text, a chat as its completion renders it). A round trip per request, but no tokenizer to ship or mount:
a registration cannot carry one, and a model's folder is the workers' own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from router.kv_routing import chat_template
from router.kv_routing.chat_template import ChatTemplate
from router.kv_routing.kv_keys import LazyIds
from router.kv_routing.token_pieces import PieceTokenizer
from router.routing.policy import RoutingView
from router.transport.upstream import UpstreamClient
from router.transport.upstream_response import UpstreamError

log = logging.getLogger("pdcluster.router")

MAX_CHARS = 32_768
BOUNDARY_TOKENS = 4  # dropped from a cut text's ids: the cut may split what a longer text makes one token
ASK_TIMEOUT = 1.0  # seconds a worker's /tokenize may take before its request is routed without ids
# What SGLang's /tokenize reads of a chat request besides messages, so that it renders them as the chat does.
CHAT_KEYS = ("tools", "tool_choice", "reasoning_effort", "continue_final_message", "chat_template_kwargs")
_JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"


class PromptTokens:
    def __init__(self) -> None:
        self.tokenizers: dict[str, PieceTokenizer | None] = {}  # model path -> its tokenizer; None: cannot be loaded
        self.templates: dict[str, ChatTemplate | None] = {}  # model path -> its chat template, compiled, if any
        self.remotes: set[str] = set()  # model paths whose tokenizer this router cannot read: a worker's /tokenize
        self._failed: set[str] = set()  # workers whose /tokenize failed, logged once each

    async def load(self, model_path: str) -> None:
        if model_path not in self.tokenizers:
            self.tokenizers[model_path] = None  # one attempt per model
            self.tokenizers[model_path], self.templates[model_path] = await asyncio.to_thread(_load, model_path)
            if self.tokenizers[model_path] is None:
                self.remotes.add(model_path)

    def remote(self, model_path: str, route: str) -> bool:
        """Whether a request's ids must come from a worker (`ask`): no tokenizer here, or a chat and no template."""
        return model_path in self.remotes or (route == CHAT and model_path in self.templates
                                              and self.templates[model_path] is None)

    async def ask(self, client: UpstreamClient, url: str, view: RoutingView) -> list[int] | None:
        """The prompt's ids by the worker at `url` (SGLang's /tokenize: its own tokenizer and chat template); None
        if it fails or takes longer than ASK_TIMEOUT."""
        body, prompt, cut = view.body, view.checked.first_prompt, False
        if view.route == CHAT:
            ask = {"messages": body.get("messages"), **{k: body[k] for k in CHAT_KEYS if body.get(k) is not None}}
        elif isinstance(prompt, str):
            ask, cut = {"prompt": prompt[:MAX_CHARS]}, len(prompt) > MAX_CHARS
        else:
            return None
        try:
            async with asyncio.timeout(ASK_TIMEOUT):
                response = await client.request("POST", url, "/tokenize", orjson.dumps(ask), _JSON)
                answer = orjson.loads(await response.read())
        except (UpstreamError, TimeoutError, orjson.JSONDecodeError) as exc:
            self._failed_once(url, type(exc).__name__)
            return None
        ids = answer.get("tokens") if isinstance(answer, dict) and response.status == 200 else None
        if not isinstance(ids, list) or (ids and type(ids[0]) is not int):
            self._failed_once(url, f"HTTP {response.status}")
            return None
        return ids[:-BOUNDARY_TOKENS] if cut else ids

    def _failed_once(self, url: str, why: str) -> None:
        if url not in self._failed:
            self._failed.add(url)
            log.warning("cache_aware: %s/tokenize failed (%s); such requests are routed by their text", url, why)

    def of(self, view: RoutingView, model_path: str | None) -> list[int] | None:
        """The prompt's leading ids (all of them, as far as this reads: `lazy`'s, read to the end)."""
        ids = self.lazy(view, model_path)
        return ids.read_all() if ids is not None else None

    def lazy(self, view: RoutingView, model_path: str | None) -> LazyIds | None:
        """The prompt's leading ids, encoded only as far as a walk reads them, with its last token spared (the
        policy matches all but the last: SGLang computes at least one)."""
        checked = view.checked
        if view.prompt_ids is not None:  # a worker's tokenizer made them (`ask`)
            given = LazyIds(view.prompt_ids, spare=1)
            if view.route != CHAT and isinstance(checked.first_prompt, str):  # `ask` sent MAX_CHARS of it
                given.chars, given.chars_read = len(checked.first_prompt), min(MAX_CHARS, len(checked.first_prompt))
            return given
        if checked.token_ids is not None:
            ids = checked.prompts[0] if checked.prompts else None
            return LazyIds(ids, spare=1) if isinstance(ids, list) else None
        tokenizer = self.tokenizers.get(model_path) if model_path is not None else None
        if tokenizer is None:
            return None
        if view.route == CHAT:
            template = self.templates.get(model_path or "")
            return _chat(tokenizer, template, view.body) if template is not None else None
        prompt = checked.first_prompt
        if not isinstance(prompt, str):
            return None
        return LazyIds([], tokenizer.pieces_ids(prompt[:MAX_CHARS], True), 1, _cut(prompt), len(prompt))


def _cut(text: str) -> int:
    """The ids dropped from the end of a text's first MAX_CHARS characters (the module's docstring)."""
    return BOUNDARY_TOKENS if len(text) > MAX_CHARS else 0


def _chat(tokenizer: PieceTokenizer, template: ChatTemplate, body: Mapping[str, Any]) -> LazyIds | None:
    rendered = template.render(body)
    if rendered is None:
        return None
    text, continued = rendered.text, rendered.continued or ""
    return LazyIds([], _chat_ids(tokenizer, template, text, continued), 1, _cut(text), len(text) + len(continued))


def _chat_ids(tokenizer: PieceTokenizer, template: ChatTemplate, text: str,
              continued: str) -> Iterator[tuple[list[int], int]]:
    yield from tokenizer.pieces_ids(text[:MAX_CHARS], False)
    if continued and len(text) + len(continued) <= MAX_CHARS:  # else: ids of a prefix
        more = tokenizer.encode(continued, special=True)  # SGLang: with special tokens, less a leading BOS
        bos = template.special.get("bos_token")
        if more and bos is not None and more[0] == tokenizer.tokenizer.token_to_id(bos):
            more = more[1:]
        yield more, len(continued)


def _load(model_path: str) -> tuple[PieceTokenizer | None, ChatTemplate | None]:
    folder = Path(model_path).expanduser()
    try:
        from tokenizers import Tokenizer  # SGLang's dependency, through transformers

        tokenizer = PieceTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), model_path)
    except Exception as exc:  # a hub id, a folder this router cannot read, a slow tokenizer only
        log.warning("cache_aware: no tokenizer for %s here (%s); its prompts' ids come from the workers' /tokenize",
                    model_path, type(exc).__name__)
        return None, None
    try:
        return tokenizer, chat_template.load(folder)
    except Exception as exc:  # a template jinja2 cannot compile, an unreadable tokenizer_config.json
        log.warning("cache_aware: no chat template for %s here (%s); its chats' ids come from the workers' /tokenize",
                    model_path, type(exc).__name__)
        return tokenizer, None
