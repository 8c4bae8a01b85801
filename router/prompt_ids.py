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
- a chat (its template rendered in Jinja) is not done yet: None, and the policy routes it by its text instead.
A tokenizer is loaded off the event loop (`load`, when a prefill is first subscribed); until then: None.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

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
    def checked(self) -> _Checked: ...


class PromptTokens:
    def __init__(self) -> None:
        self.tokenizers: dict[str, Any] = {}  # model path -> tokenizers.Tokenizer, or None: cannot be loaded

    async def load(self, model_path: str) -> None:
        if model_path not in self.tokenizers:
            self.tokenizers[model_path] = None  # one attempt per model
            self.tokenizers[model_path] = await asyncio.to_thread(_load, model_path)

    def of(self, request: _Request, model_path: str | None) -> list[int] | None:
        checked = request.checked
        if checked.token_ids is not None:
            ids = checked.prompts[0] if checked.prompts else None
            return ids if isinstance(ids, list) else None
        prompt = checked.first_prompt
        if request.route == "/v1/chat/completions" or not isinstance(prompt, str) or model_path is None:
            return None
        tokenizer = self.tokenizers.get(model_path)
        if tokenizer is None:
            return None
        ids = tokenizer.encode(prompt[:MAX_CHARS]).ids
        return ids if len(prompt) <= MAX_CHARS else ids[:-BOUNDARY_TOKENS]


def _load(model_path: str) -> Any:
    try:
        from tokenizers import Tokenizer  # SGLang's dependency, through transformers

        return Tokenizer.from_file(str(Path(model_path).expanduser() / "tokenizer.json"))
    except Exception as exc:  # a hub id, a folder this router cannot read, a slow tokenizer only
        log.warning("cache_aware: no tokenizer for %s (%s); its text prompts are routed by their text", model_path,
                    type(exc).__name__)
        return None
