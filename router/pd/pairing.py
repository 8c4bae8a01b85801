"""Pairing: which decode and which prefill serve an attempt. A pipeline of named stages, as llm-d's
filter -> scorer -> picker: filters narrow each role's candidates, then the role's policy picks one.

    decode:  available -> pairable (some available prefill can send it KV) -> holds the prompt -> decode policy
    prefill: available -> compatible with the chosen decode               -> prefill policy

"available": usable (Worker.unusable: registry, probes, liveness, breaker), and not tried already by this request,
unless every available worker of the role has been (then tried ones may serve again); of the model an OpenAI request
names (`serves`; a name no worker serves is a 404 model_not_found). A later choice of an OpenAI
request with `n` (router/openai/fanout.py) keeps to the prefill that holds its prompt already, while it is available.
"Holds the prompt": its KV pool can pre-allocate it (why and how: router/pd/kv_fit.py; else PromptTooLong).
"Compatible": same model identity (model, page size, KV dtype, transfer backend; static workers match anything).
The policies, chosen by name in the router config (router/pd/policies.py), are the pickers: each reads the request
only through a RoutingView (`view`, made once per request) and returns its pick, the prefill policy the pair's
Choice (router/routing/policy.py). Then the pair's limits: the request's token ids and lengths against what both
halves can take.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from pdcluster.common.http import ApiError
from pdcluster.common.protocol import Role, WorkerCapabilities
from router.checks.chat_checks import check_pair_has
from router.checks.checked import Checked
from router.checks.inventory.rules import PairLimit
from router.fleet.workers import Worker, WorkerPool
from router.pd.request import PdRequest
from router.routing.policy import Choice, Policy, RoutingView


def serves(worker: Worker, model: str | None) -> bool:
    """Whether the worker serves the model a request names (its served name or its path; None: any). A static
    worker, whose model the router does not know, serves any."""
    identity = worker.identity
    return model is None or identity is None or model in (identity.served_model_name, identity.model_path)


def requested_model(request: PdRequest) -> str | None:
    """The model an OpenAI request names (native /generate names none)."""
    model = request.body.get("model") if request.route != "/generate" else None
    return model if isinstance(model, str) else None


def available(pool: WorkerPool, role: Role, tried: set[str], model: str | None = None) -> list[Worker]:
    workers = [w for w in pool.of_role(role) if not w.unusable() and serves(w, model)]
    untried = [w for w in workers if w.worker_id not in tried] if tried else workers
    return untried or workers


def pairable(decodes: list[Worker], prefills: list[Worker]) -> list[Worker]:
    return [d for d in decodes if any(p.compatible_with(d) for p in prefills)]


def preferred(prefills: list[Worker], decodes: list[Worker], worker_id: str) -> list[Worker]:
    """Only the prefill `worker_id` if it is available and pairs with an available decode; else all of them."""
    chosen = [p for p in prefills if p.worker_id == worker_id]
    return chosen if pairable(decodes, chosen) else prefills


def compatible_with(decode: Worker, prefills: list[Worker]) -> list[Worker]:
    return [p for p in prefills if p.compatible_with(decode)]


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


class Pairing:
    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy):
        self.pool, self.prefill_policy, self.decode_policy = pool, prefill_policy, decode_policy
        pool.on_removed.append(self.worker_removed)  # the policies forget a worker that left the pool

    async def view(self, request: PdRequest, prepared: bool = True) -> RoutingView:
        """What the policies read of the request, for all its attempts: with the prompt's ids if the prefill policy's
        `prepare` gets them (unless not `prepared`: a fan-out's later choice, whose prefill is chosen already)."""
        view = RoutingView(request.route, request.body, request.checked)
        if (prepare := self.prefill_policy.prepare) is None or not prepared:
            return view
        model = requested_model(request)
        ids = await prepare(available(self.pool, Role.PREFILL, request.tried, model), view)
        return view if ids is None else RoutingView(request.route, request.body, request.checked, ids)

    def choose(self, request: PdRequest, view: RoutingView, prefer_prefill: str | None = None) -> Choice:
        """The pair for the request's next attempt, and what the prefill policy expects there; 503 if no pair can
        serve it. `prefer_prefill`: a fan-out's later choice's, where its prompt is cached already."""
        model = requested_model(request)
        if model is not None and not any(serves(w, model) for w in self.pool.workers.values()):
            raise ApiError(404, f"the model {model!r} is not served here", "model", "model_not_found")
        prefills = available(self.pool, Role.PREFILL, request.tried, model)
        decodes = available(self.pool, Role.DECODE, request.tried, model)
        if prefer_prefill is not None:
            prefills = preferred(prefills, decodes, prefer_prefill)
        candidates = pairable(decodes, prefills)
        if not candidates:
            detail = "no prefill is compatible with any decode" if prefills and decodes else (
                f"{len(prefills)} prefill and {len(decodes)} decode workers available")
            raise ApiError(503, f"no healthy pair: {detail}")
        candidates = holding(candidates, request.checked)
        decode = self.decode_policy.choose(candidates, view)
        return self.prefill_policy.choose_prefill(decode, compatible_with(decode, prefills), view)

    def worker_removed(self, worker_id: str) -> None:
        self.prefill_policy.worker_removed(worker_id)
        self.decode_policy.worker_removed(worker_id)


# --- the pair's limits -----------------------------------------------------------------------------------------------

def pair_limits(prefill: Worker, decode: Worker) -> ModelLimits:
    """What both halves can take (the smaller of what each registered): the prompt's token ids are checked against
    it (check_for_pair)."""
    vocab = [w.vocab_size for w in (prefill, decode) if w.vocab_size is not None]
    context = [w.context_length for w in (prefill, decode) if w.context_length is not None]
    return ModelLimits(min(vocab) if vocab else None, min(context) if context else None,
                       ((f"prefill {prefill.worker_id}", prefill.capabilities),
                        (f"decode {decode.worker_id}", decode.capabilities)))


@dataclass(frozen=True)
class ModelLimits:
    """What a pair of workers can take: ids must be < vocab_size, a prompt at most context_length tokens; and what
    each of the two runs with (named "prefill <id>", "decode <id>"; none known: nothing that needs them passes)."""

    vocab_size: int | None
    context_length: int | None
    capabilities: tuple[tuple[str, WorkerCapabilities], ...] = ()


def check_for_pair(checked: Checked, limits: ModelLimits) -> None:
    """400 naming the field (the bad id and its position, or what the pair lacks); 503: ids that cannot be checked."""
    for field, need in checked.needs:
        check_pair_has(field, need, limits.capabilities)
    _check_prompts(checked, limits)
    vocab = limits.vocab_size
    for field, ids in checked.id_fields:
        if vocab is None:
            raise _unknown_vocabulary(field)
        for position, token in enumerate(ids):
            if token >= vocab:
                raise ApiError(400, f"{field}[{position}] is {token}: token ids must be in [0, {vocab}) for this "
                                    f"model", field)
    context = limits.context_length
    if context is None:
        return
    for field, value, limit in checked.counts:
        if value > context or (limit is PairLimit.POSITION and value >= context):
            raise ApiError(400, f"{field} is {value}; the model's context length is {context}", field)


def _unknown_vocabulary(field: str | None) -> ApiError:
    return ApiError(503, f"{field}: the serving workers' vocabulary size is unknown, so token ids cannot be checked "
                         f"(static workers need vocab_size in the router config)", field)


def _check_prompts(checked: Checked, limits: ModelLimits) -> None:
    if not checked.prompts:
        return
    field = checked.token_ids
    if limits.vocab_size is None:
        raise _unknown_vocabulary(field)
    for item, ids in enumerate(checked.prompts):
        where = f"{field}[{item}]" if checked.batch_size is not None else field
        # Length first: it costs nothing, and bounds the per-id work below by the context length.
        if limits.context_length is not None and len(ids) > limits.context_length:
            raise ApiError(400, f"{where} has {len(ids)} tokens; the model's context length is "
                                f"{limits.context_length}", field)
        if set(map(type, ids)) != {int}:  # bool and float are not token ids
            position = next(i for i, t in enumerate(ids) if type(t) is not int)
            raise ApiError(400, f"{where}[{position}] is {orjson.dumps(ids[position]).decode()[:40]}, not a token "
                                f"id (an integer)", field)
        if min(ids) < 0 or max(ids) >= limits.vocab_size:
            position = next(i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size)
            raise ApiError(400, f"{where}[{position}] is {ids[position]}: token ids must be in "
                                f"[0, {limits.vocab_size}) for this model", field)
