"""The `cache_aware` policy: the prefill that will finish the prompt first, from what each holds, by its own KV
events (router/kv_events.py, router/kv_index.py), and how busy it is.

Each candidate's cost is the prompt tokens it would still compute, queued ones included: the prompt tokens of this
router's prefill halves on it not yet answered (`pending_prompt_tokens`), a fixed allowance per request in flight,
and the request's own tokens less the ones it holds. The cheapest wins; ties go to the one holding more, then at
random. So a long cached prefix draws its traffic to its holder until that holder's queue costs more than the hit
saves, and a small hit never outweighs a queue. What it holds is what SGLang reuses: whole pages, of all but the
prompt's last token (SGLang computes at least one).

The prompt's token ids (router/prompt_ids.py): given, or by the model's tokenizer where this router can read its
folder; else (compose, Kubernetes: the workers downloaded the model) `prepare` asks a candidate's own /tokenize
first, once per request, so the router needs no model of its own.

Blind: when no candidate's events were heard (none publishes, or none got through yet), it routes as round robin
does (perhaps no candidate has a radix cache: affinity would cost balance for nothing). When the prompt's ids are
unknown, the text `prefix` policy decides (router/pairing.py's PrefixAffinity: pairing gives both, as this module
does not import it). A candidate not heard from, beside ones that were, is taken to hold nothing (routed by load).
One candidate: no choice, nothing tokenized. Every choice is counted by kind, and what the chosen prefill was
predicted to hold is kept on the request, to compare with what its answer reports (`meta_info.cached_tokens`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from router.kv_index import KvIndex
from router.metrics import RouterMetrics
from router.prompt_ids import Client, PromptTokens
from router.request import PdRequest
from router.workers import Worker

REQUEST_TOKENS = 64  # what a request in flight costs besides its prompt tokens (scheduling, its transfer)


class Fallback(Protocol):
    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker: ...

    def worker_removed(self, worker_id: str) -> None: ...


class CacheAware:
    """A pairing Policy (router/pairing.py's interface)."""

    name = "cache_aware"
    needs_prompt = True  # for the prefix fallback

    def __init__(self, fallback: Fallback, blind: Fallback, seed: int | None = None) -> None:
        self.index = KvIndex()
        self.tokens = PromptTokens()
        self.fallback, self.blind = fallback, blind
        # Set with the event subscriptions (router/kv_events.py: start): the metrics, and the client of `prepare`.
        self.metrics: RouterMetrics | None = None
        self.client: Client | None = None
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Worker], prompt: str) -> Worker:
        return self.fallback.choose(candidates, prompt)  # no request: by its text only

    async def prepare(self, candidates: Sequence[Worker], request: PdRequest) -> None:
        """Before the request's first choice: a text or chat prompt whose model's tokenizer this router cannot read
        gets its ids from the least busy indexed candidate's /tokenize (on a failure, none: routed by its text)."""
        client = self.client
        if client is None or len(candidates) < 2 or request.prompt_ids is not None or request.checked.token_ids:
            return
        indexed = [w for w in candidates if self.index.heard(w.worker_id)]
        identity = indexed[0].identity if indexed else None
        if identity is not None and self.tokens.remote(identity.model_path, request.route):
            worker = min(indexed, key=lambda w: (w.pending_prompt_tokens, self._rng.random()))
            request.prompt_ids = await self.tokens.ask(client, worker.url, request)

    def choose_for(self, candidates: Sequence[Worker], request: PdRequest) -> Worker:
        request.predicted_cached = None
        if len(candidates) == 1:
            return candidates[0]
        indexed = [w for w in candidates if self.index.heard(w.worker_id)]
        if not indexed:
            return self._count("blind", self.blind.choose(candidates, ""))
        model = next((w.identity.model_path for w in indexed if w.identity is not None), None)
        ids = self.tokens.of(request, model)
        if ids is None:
            return self._count("no_tokens", self.fallback.choose(candidates, request.hint))
        held = self.index.match([w.worker_id for w in indexed], ids, len(ids) - 1)
        chosen = self.pick(candidates, held, len(ids))
        if request.checked.batch_size is None:  # a batch's answer counts all its prompts: no comparison
            request.predicted_cached = held.get(chosen.worker_id, 0)
        return self._count("indexed", chosen)

    def pick(self, candidates: Sequence[Worker], held: dict[str, int], prompt_tokens: int) -> Worker:
        """The cheapest candidate (the module's docstring), given the tokens each holds of a prompt's."""
        def cost(w: Worker) -> tuple[int, int, float]:
            hit = held.get(w.worker_id, 0)
            work = w.pending_prompt_tokens + REQUEST_TOKENS * w.in_flight + prompt_tokens - hit
            return work, -hit, self._rng.random()

        return min(candidates, key=cost)

    def _count(self, kind: str, chosen: Worker) -> Worker:
        if self.metrics is not None:
            self.metrics.routing.labels(kind).inc()
        return chosen

    def worker_removed(self, worker_id: str) -> None:
        self.fallback.worker_removed(worker_id)
        self.blind.worker_removed(worker_id)
