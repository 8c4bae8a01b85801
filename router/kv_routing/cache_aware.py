"""The `cache_aware` policy: the prefill that will finish the prompt first, from what each holds, by its own KV
events (router/kv_routing/kv_events.py, router/kv_routing/kv_index.py), and how busy it is.

Each candidate's cost is the prompt tokens it would still compute, queued ones included: what this router's prefill
halves on it not yet answered will compute (`pending_work_tokens`: each prompt's tokens less what it was predicted to
hold, so queued repeats of a prompt it holds are short work), a fixed allowance per request in flight, and the
request's own tokens less the ones it holds; and, computing what another candidate holds, that much again
(DUPLICATE_COST): the copy is work the cluster does for nothing and memory it spends twice, which a request's own
time to finish does not see (measured without it: a tenant's second request, sent while its first was queued, went to
the idle prefill, and every tenant ended up on both, 0.91 of the oracle's cached tokens, no more than round robin).
The cheapest wins; ties go to the one holding more, then at random. So a long cached prefix draws its traffic to its
holder until that holder's queue costs more than twice the hit, and a small hit never outweighs a queue. What it
holds is what SGLang reuses: whole pages, of all but the prompt's last token (SGLang computes at least one); and what
this router sent it in the last seconds, which its events tell only once computed (router/kv_routing/kv_routed.py: a
burst sharing a new prefix goes to one prefill).

A prefill with a KV store on disk also holds the pages after its memory's prefix that are on its store, wherever they
came from: a replica sharing the store, or itself before a restart (router/kv_routing/kv_index.py). Reading them is
cheaper than computing them and dearer than memory: each costs STORED_TOKEN_COST of a computed token. Measured with
the CPU attention plugin (on by default; bench/README.md, KV persistence), a disk hit's TTFT over a memory hit's is
3-16% of the cold prompt's (llama-small, 8192 tokens: 1.34 s vs 0.59 s of 22 s; SmolLM2, 8000: 16.7 s vs 3.0 s of
87 s); a quarter leaves a margin for pages out of the page cache. So a replica holding a prompt in memory wins over
one that would read it, unless its queue costs more than that difference.

The prompt's token ids (router/kv_routing/prompt_ids.py): given, or by the model's tokenizer where this router can
read its folder; else (compose, Kubernetes: the workers downloaded the model) `prepare` asks a candidate's own
/tokenize first, once per request, so the router needs no model of its own. A text is encoded only as far as a
candidate holds it and a chunk more (router/kv_routing/kv_keys.py's LazyIds): the match needs no more, so a prompt
none holds costs a piece's encode (~0.1 ms), not its whole (~7 ms at 8k tokens). Its tokens not read are booked at
the rate a character of those read (an estimate; the router's own, 2 characters a token, is ~3x too high for
English). The chosen prefill is credited with the prompt (router/kv_routing/kv_routed.py) in the event loop's next
turn, the rest of its text encoded then: off the request's path, before the next request's decision as a rule.

Blind: when no candidate's events were heard (none publishes, or none got through yet) and none's store is known to
hold a page, it routes as round robin does (perhaps no candidate has a radix cache: affinity would cost balance for
nothing). When the prompt's ids are unknown, the text `prefix` policy decides (router/routing/policy.py's
PrefixAffinity: the registry, router/pd/policies.py, gives both). A candidate not heard from, beside known ones,
holds only its store's pages (a restarted prefill, before its first event). One candidate: no choice, nothing
tokenized. Every choice is counted by kind; as the prefill policy, its Choice carries what the chosen prefill was
predicted to hold, to compare with what its answer reports (`meta_info.cached_tokens`), and what it will compute.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from router.fleet.workers import Worker
from router.kv_routing.kv_index import KvIndex
from router.kv_routing.kv_keys import Held, LazyIds, chunk_tokens
from router.kv_routing.kv_routed import Routed, RoutedPrompts
from router.kv_routing.prompt_ids import PromptTokens
from router.metrics import RouterMetrics
from router.routing.policy import Choice, Policy, RoutingView
from router.transport.upstream import UpstreamClient

REQUEST_TOKENS = 64  # what a request in flight costs besides its prompt tokens (scheduling, its transfer)
DUPLICATE_COST = 1.0  # a token computed that another candidate holds, besides its computing (the docstring)
STORED_TOKEN_COST = 0.25  # a prompt token read from the KV store, in computed tokens (the module's docstring)

# A decision: the worker, the cached tokens predicted there (None: no prediction) and the tokens it will compute (None:
# the router's estimate stands).
Decision = tuple[Worker, int | None, int | None]


class CacheAware(Policy):
    """The module's docstring; `fallback` routes a prompt without ids, `blind` a choice the index knows nothing of."""

    name = "cache_aware"

    def __init__(self, fallback: Policy, blind: Policy, seed: int | None = None) -> None:
        self.index = KvIndex()
        self.routed = RoutedPrompts()  # what it sent each prefill lately, before their events tell (kv_routed.py)
        self.tokens = PromptTokens()
        self.fallback, self.blind = fallback, blind
        # Set with the event subscriptions (router/kv_routing/kv_events.py: start): the metrics, and the client of
        # `prepare`.
        self.metrics: RouterMetrics | None = None
        self.client: UpstreamClient | None = None
        self._rng = random.Random(seed)

    async def prepare(self, candidates: Sequence[Worker], view: RoutingView) -> list[int] | None:
        """Before the request's first choice: a text or chat prompt whose model's tokenizer this router cannot read
        gets its ids from the least busy indexed candidate's /tokenize (on a failure, none: routed by its text)."""
        client = self.client
        if client is None or len(candidates) < 2 or view.prompt_ids is not None or view.checked.token_ids:
            return None
        indexed = self._indexed(candidates)
        identity = indexed[0].identity if indexed else None
        if identity is None or not self.tokens.remote(identity.model_path, view.route):
            return None
        worker = min(indexed, key=lambda w: (w.pending_prompt_tokens, self._rng.random()))
        return await self.tokens.ask(client, worker.url, view)

    def choose(self, candidates: Sequence[Worker], view: RoutingView) -> Worker:
        """As the decode policy: the same decision, its prediction unused."""
        return self._decide(candidates, view)[0]

    def choose_prefill(self, decode: Worker, prefills: Sequence[Worker], view: RoutingView) -> Choice:
        prefill, predicted, work = self._decide(prefills, view)
        return Choice(prefill, decode, predicted, work)

    def _decide(self, candidates: Sequence[Worker], view: RoutingView) -> Decision:
        if len(candidates) == 1:
            return candidates[0], None, None
        indexed = self._indexed(candidates)
        if not indexed:
            return self._count("blind", self.blind.choose(candidates, view)), None, None
        model = next((w.identity.model_path for w in indexed if w.identity is not None), None)
        ids = self.tokens.lazy(view, model)
        if ids is None:
            return self._count("no_tokens", self.fallback.choose(candidates, view)), None, None
        # Read (and encoded) only while some candidate holds the next chunk: a prompt none holds costs a piece's encode.
        held = self.index.held([(w.worker_id, _store(w)) for w in indexed], ids)
        page = next((w.identity.page_size for w in indexed if w.identity is not None and w.identity.page_size), 1)
        chunk = chunk_tokens(page)
        memory = {worker_id: part.memory for worker_id, part in held.items()}
        for worker_id, tokens in self.routed.held([w.worker_id for w in indexed], chunk, ids, memory, False).items():
            _also_holds(held.setdefault(worker_id, Held()), tokens)
        # The prompt's tokens: counted if read to its end, else the part read and the rest at its tokens a character
        # (LazyIds.tokens); a batch's: the router's estimate of all its prompts (Checked.prompt_tokens), if more.
        single = view.checked.batch_size is None
        total = ids.tokens() if single else max(ids.tokens(), view.checked.prompt_tokens)
        chosen = self.pick(candidates, held, total)
        self._credit(chosen.worker_id, chunk, ids)
        predicted = held.get(chosen.worker_id, Held()).tokens
        # The work: what its prefill half books (router/pd/attempt.py's PrefillHalf). A batch's answer counts all its
        # prompts' cached tokens: no prediction to compare with.
        return self._count("indexed", chosen), predicted if single else None, max(0, total - predicted)

    def _credit(self, worker_id: str, chunk: int, ids: LazyIds) -> None:
        """The prompt counted as sent to the worker (router/kv_routing/kv_routed.py): its first chunk now, all the rest
        (encoding the rest of the text) once the request is on its way, in the event loop's next turn: counting an
        8k-token prompt's chunks costs ~0.1 ms, which only a decision in that same turn could use, and so does
        forgetting an old one's."""
        routed = self.routed.add(worker_id, chunk, ids.chunk_keys(chunk)[:1], tidy=False)
        try:
            asyncio.get_running_loop().call_soon(self._credit_rest, routed, worker_id, chunk, ids)
        except RuntimeError:  # no loop (a benchmark, a test): at once
            self._credit_rest(routed, worker_id, chunk, ids)

    def _credit_rest(self, routed: Routed | None, worker_id: str, chunk: int, ids: LazyIds) -> None:
        keys = ids.all_chunk_keys(chunk)
        if routed is None:
            self.routed.add(worker_id, chunk, keys, tidy=False)
        else:
            self.routed.extend(routed, keys)
        self.routed.tidy()  # what expired, and the oldest past the bound: not in a decision either

    def pick(self, candidates: Sequence[Worker], held: dict[str, Held], prompt_tokens: int) -> Worker:
        """The cheapest candidate (the module's docstring), given what each holds of a prompt's tokens."""
        hits = {w.worker_id: _hit(held.get(w.worker_id) or Held()) for w in candidates}
        best = max(hits.values())

        def cost(w: Worker) -> tuple[float, float, float]:
            hit = hits[w.worker_id]
            work = w.pending_work_tokens + REQUEST_TOKENS * w.in_flight + prompt_tokens - hit
            return work + DUPLICATE_COST * (best - hit), -hit, self._rng.random()

        return min(candidates, key=cost)

    def _indexed(self, candidates: Sequence[Worker]) -> list[Worker]:
        return [w for w in candidates if self.index.known(w.worker_id, _store(w))]

    def _count(self, kind: str, chosen: Worker) -> Worker:
        if self.metrics is not None:
            self.metrics.routing.labels(kind).inc()
        return chosen

    def worker_removed(self, worker_id: str) -> None:
        self.routed.drop(worker_id)
        self.fallback.worker_removed(worker_id)
        self.blind.worker_removed(worker_id)


def _hit(held: Held) -> float:
    """What holding `held` saves, in computed tokens."""
    return held.memory + (1 - STORED_TOKEN_COST) * held.stored


def _also_holds(held: Held, tokens: int) -> None:
    """`held` with the first `tokens` in memory (a prompt routed there lately), if that is more."""
    if tokens > held.memory:
        held.stored = max(0, held.stored - (tokens - held.memory))
        held.memory = tokens


def _store(worker: Worker) -> str | None:
    return worker.kv_store.store if worker.kv_store else None
