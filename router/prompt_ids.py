"""A request's leading token ids, as the engine makes them, for the cache_aware policy (router/cache_aware.py).

The router does not otherwise tokenize (router/request.py estimates; router/kv_fit.py asks a decode's /tokenize only
when a bound cannot decide, a round trip per request). Here the cheapest correct path is taken:
- prompts given as token ids (`input_ids`, a completion's `prompt` of ids): those, as they are;
- a text prompt (`/generate`'s `text`, a completion's `prompt`): the model's own `tokenizer.json`, loaded with the
  `tokenizers` library (Rust; what SGLang's fast tokenizer runs) from the model folder the prefills registered, if
  this router can read it (`make up`, the tests; in compose or Kubernetes the router needs the model mounted).
  SGLang encodes a text with its special tokens (`tokenizer.encode(text)`), and so does this. Only the first
  MAX_CHARS characters are encoded, less the last tokens, which a longer text may merge differently: prefix matching
  needs no more, and the cost stays bounded;
- a chat: its messages rendered by the model's chat template as SGLang renders them (router/chat_template.py), then
  encoded as a text is, but with no special tokens added (the template writes its own), and the text of a final
  assistant message it continues after them. A chat the renderer does not follow: None, routed by its text.
A tokenizer and template are loaded off the event loop (`load`, when a prefill is first subscribed); until then: None.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

from router import chat_template
from router.chat_template import ChatTemplate

log = logging.getLogger("pdcluster.router")

MAX_CHARS = 32_768
BOUNDARY_TOKENS = 4  # dropped from a cut text's ids: the cut may split what a longer text makes one token


class _Checked(Protocol):  # router/request.py's Checked, what is read of it (not imported: a short import chain)
    @property
    def token_ids(self) -> str | None: ...
    @property
    def prompts(self) -> tuple[list, ...]: ...
    @property
    def first_prompt(self) -> Any: ...


class _Request(Protocol):  # ... and its PdRequest
    @property
    def route(self) -> str: ...
    @property
    def body(self) -> dict[str, Any]: ...
    @property
    def checked(self) -> _Checked: ...


class PromptTokens:
    def __init__(self) -> None:
        self.tokenizers: dict[str, Any] = {}  # model path -> tokenizers.Tokenizer, or None: cannot be loaded
        self.templates: dict[str, ChatTemplate | None] = {}  # model path -> its chat template, compiled, if any

    async def load(self, model_path: str) -> None:
        if model_path not in self.tokenizers:
            self.tokenizers[model_path] = None  # one attempt per model
            self.tokenizers[model_path], self.templates[model_path] = await asyncio.to_thread(_load, model_path)

    def of(self, request: _Request, model_path: str | None) -> list[int] | None:
        checked = request.checked
        if checked.token_ids is not None:
            ids = checked.prompts[0] if checked.prompts else None
            return ids if isinstance(ids, list) else None
        tokenizer = self.tokenizers.get(model_path) if model_path is not None else None
        if tokenizer is None:
            return None
        if request.route == "/v1/chat/completions":
            template = self.templates.get(model_path or "")
            return _chat(tokenizer, template, request.body) if template is not None else None
        prompt = checked.first_prompt
        return _encode(tokenizer, prompt, special=True) if isinstance(prompt, str) else None


def _chat(tokenizer: Any, template: ChatTemplate, body: dict[str, Any]) -> list[int] | None:
    rendered = template.render(body)
    if rendered is None:
        return None
    ids = _encode(tokenizer, rendered.text, special=False)
    if rendered.continued and len(rendered.text) + len(rendered.continued) <= MAX_CHARS:  # else: ids of a prefix
        more = tokenizer.encode(rendered.continued).ids  # SGLang: with special tokens, less a leading BOS
        bos = template.special.get("bos_token")
        if more and bos is not None and more[0] == tokenizer.token_to_id(bos):
            more = more[1:]
        ids += more
    return ids


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    """The ids of at most MAX_CHARS of `text`, less the last few of a cut one (the module's docstring)."""
    ids: list[int] = tokenizer.encode(text[:MAX_CHARS], add_special_tokens=special).ids
    return ids if len(text) <= MAX_CHARS else ids[:-BOUNDARY_TOKENS]


def _load(model_path: str) -> tuple[Any, ChatTemplate | None]:
    folder = Path(model_path).expanduser()
    try:
        from tokenizers import Tokenizer  # SGLang's dependency, through transformers

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # a hub id, a folder this router cannot read, a slow tokenizer only
        log.warning("cache_aware: no tokenizer for %s (%s); its text prompts are routed by their text", model_path,
                    type(exc).__name__)
        return None, None
    try:
        return tokenizer, chat_template.load(folder)
    except Exception as exc:  # a template jinja2 cannot compile, an unreadable tokenizer_config.json
        log.warning("cache_aware: no chat template for %s (%s); its chats are routed by their text", model_path,
                    type(exc).__name__)
        return tokenizer, None
