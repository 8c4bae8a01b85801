"""Pairing: which decode and which prefill serve an attempt. A pipeline of named stages, as llm-d's
filter -> scorer -> picker: filters narrow each role's candidates, then the role's policy picks one.

    decode:  available -> pairable (some available prefill can send it KV) -> holds the prompt -> decode policy
    prefill: available -> compatible with the chosen decode               -> prefill policy

"available": usable (Worker.unusable: registry, probes, liveness, breaker), and not tried already by this request,
unless every available worker of the role has been (then tried ones may serve again).
"Holds the prompt": its KV pool can pre-allocate it (router/kv_fit.py; else PromptTooLong).
"Compatible": same model identity (model, page size, KV dtype, transfer backend; static workers match anything).
"""

from __future__ import annotations

from pdcluster.http import ApiError
from pdcluster.protocol import Role
from router.kv_fit import holding
from router.policies import Policy
from router.request import PdRequest
from router.validation import ModelLimits
from router.workers import Worker, WorkerPool


def available(pool: WorkerPool, role: Role, tried: set[str]) -> list[Worker]:
    workers = [w for w in pool.of_role(role) if not w.unusable()]
    untried = [w for w in workers if w.worker_id not in tried] if tried else workers
    return untried or workers


def pairable(decodes: list[Worker], prefills: list[Worker]) -> list[Worker]:
    return [d for d in decodes if any(p.compatible_with(d) for p in prefills)]


def compatible_with(decode: Worker, prefills: list[Worker]) -> list[Worker]:
    return [p for p in prefills if p.compatible_with(decode)]


class Pairing:
    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy):
        self.pool, self.prefill_policy, self.decode_policy = pool, prefill_policy, decode_policy
        pool.on_removed.append(self.worker_removed)  # the policies forget a worker that left the pool

    def choose(self, request: PdRequest) -> tuple[Worker, Worker]:
        """(prefill, decode) for the request's next attempt; 503 if no pair can serve it."""
        prefills = available(self.pool, Role.PREFILL, request.tried)
        decodes = available(self.pool, Role.DECODE, request.tried)
        candidates = pairable(decodes, prefills)
        if not candidates:
            detail = "no prefill is compatible with any decode" if prefills and decodes else (
                f"{len(prefills)} prefill and {len(decodes)} decode workers available")
            raise ApiError(503, f"no healthy pair: {detail}")
        candidates = holding(candidates, request.checked)
        decode = self.decode_policy.choose(candidates, _prompt(self.decode_policy, request))
        prefill = self.prefill_policy.choose(compatible_with(decode, prefills), _prompt(self.prefill_policy, request))
        return prefill, decode

    def worker_removed(self, worker_id: str) -> None:
        self.prefill_policy.worker_removed(worker_id)
        self.decode_policy.worker_removed(worker_id)


def _prompt(policy: Policy, request: PdRequest) -> str:
    return request.hint if policy.needs_prompt else ""


def pair_limits(prefill: Worker, decode: Worker) -> ModelLimits:
    """What both halves can take (the smaller of what each registered): the prompt's token ids are checked against
    it (router/validation.py)."""
    vocab = [w.vocab_size for w in (prefill, decode) if w.vocab_size is not None]
    context = [w.context_length for w in (prefill, decode) if w.context_length is not None]
    return ModelLimits(min(vocab) if vocab else None, min(context) if context else None)
