"""Admission: a new or restarted worker gets traffic only once one short greedy canary through a pair with it gives
the tokens a trusted pair gives.

A worker can come back wrong: other weights under the same path and name (the model identity matches, so nothing
else would notice), a broken KV transfer, a bad device. Each worker instance (its launcher's `instance_id`: a
restarted worker is a new one) is checked once, when it appears, never again: the canary is CANARY_TOKENS greedy
tokens from a fixed prompt of token ids, through the new worker and an admitted worker of the other role, compared
with what an admitted pair of the same model identity answers (the reference, asked once per identity). A mismatch
keeps the worker out for the life of that instance, says why in /ready and counts in
pdcluster_router_admissions_total{result="refused"}; a canary that fails to run (a timeout, a 5xx) is tried again.

Trust has to start somewhere: when no worker of an identity is admitted (a cold start, a router that just started, or
every worker of the model restarted at once), the first pair's canary is the reference and both are admitted; every
later worker is checked against it. A reference lives only while a worker admitted by it does: kept longer, a cluster
restarted whole on new weights under the same path would wait forever for workers that answer like the old ones.
Static workers are checked like discovered ones.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from pdcluster.common.protocol import Role
from router.checks.validation import check_generate
from router.fleet.workers import Admission, Worker, WorkerPool
from router.pd.attempt import Attempt
from router.pd.failures import HALF_ERRORS
from router.pd.request import PdRequest
from router.routing.policy import Choice
from router.transport.edge import Answer

log = logging.getLogger("pdcluster.router")

CANARY_TOKENS = 8
CANARY_PROMPT = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233]  # reduced modulo the vocabulary
RETRY_AFTER = 3.0  # seconds before a canary that could not run is tried again
CANARY_TIMEOUT = 120.0  # a cold CPU worker's first forward passes are slow


class Admissions:
    """Runs the canaries of the pool's pending workers (`run`, a task for the router's lifetime)."""

    def __init__(self, pool: WorkerPool, dispatcher_ref, metrics, interval: float = 0.5):
        self.pool, self._dispatcher_ref, self.metrics, self.interval = pool, dispatcher_ref, metrics, interval
        self.references: dict[str, list[int]] = {}  # identity key -> the reference answer's output ids
        self.settled = asyncio.Event()  # no worker waits for its canary (a starting router serves from then on)
        self._retry_at: dict[Worker, float] = {}
        self._told: set[Worker] = set()  # pending workers whose wait has been logged once

    async def run(self) -> None:
        while True:
            try:
                await self.admit_pending()
            except Exception:  # one canary's surprise must not end every later admission (workers would wait forever)
                log.exception("admission round failed; trying again")
            await asyncio.sleep(self.interval)

    async def admit_pending(self) -> None:
        self._forget_orphaned_references()
        pending = [w for w in self.pool.workers.values() if w.admission is Admission.PENDING]
        if not pending:
            self.settled.set()
            return
        now = time.monotonic()
        for worker in pending:  # (a canary admits two workers at once: one of them may be done already)
            if worker.admission is Admission.PENDING and self._retry_at.get(worker, 0.0) <= now and \
                    not worker.unusable(ignore_admission=True):
                await self._admit(worker)

    async def _admit(self, worker: Worker) -> None:
        key = _identity_key(worker)
        if key not in self.references and (pair := _trusted_pair(self.pool, key)) is not None:
            reference = await self._canary(*pair)  # an admitted pair of this model: asked once, then kept
            if reference is None:
                return
            self.references[key] = reference
        partner = _partner(self.pool, worker, admitted=True) or _partner(self.pool, worker, admitted=False)
        if partner is None:
            return  # nobody of the other role to pair it with yet
        answer = await self._canary(worker, partner)
        if answer is None:
            return
        first = key not in self.references  # none trusted yet: the first pair sets the reference
        reference = self.references.setdefault(key, answer)
        if answer == reference:
            note = ("the first pair of its model: its canary is the reference" if first
                    else f"canary matched through {partner.worker_id}")
            for w in (worker, partner):
                self._decide(w, Admission.ADMITTED, note)
        elif partner.admission is Admission.ADMITTED:
            self._decide(worker, Admission.REFUSED, f"canary through {partner.worker_id} answered {answer}; admitted "
                                                    f"workers of the same model answer {reference}")
        else:  # two new workers disagree with the reference: which one is wrong is not known; pair them otherwise
            self._retry_at[worker] = time.monotonic() + RETRY_AFTER
            if worker not in self._told:
                self._told.add(worker)
                log.warning("two new workers answer the canary otherwise than admitted workers of their model; both "
                            "wait for an admitted partner", extra={"worker": worker.worker_id,
                                                                    "partner": partner.worker_id})

    def _forget_orphaned_references(self) -> None:
        admitted = {_identity_key(w) for w in self.pool.workers.values() if w.admission is Admission.ADMITTED}
        for key in [k for k in self.references if k not in admitted]:
            del self.references[key]
            log.info("admission reference forgotten: no worker admitted by it is left", extra={"identity": key})
        self._told &= set(self.pool.workers.values())

    async def _canary(self, worker: Worker, partner: Worker) -> list[int] | None:
        """The canary's output ids through the pair of `worker` and `partner`; None if it could not run."""
        prefill, decode = (worker, partner) if worker.role is Role.PREFILL else (partner, worker)
        vocab = min(v for v in (prefill.vocab_size, decode.vocab_size, 1 << 30) if v)
        body = {"input_ids": [i % vocab for i in CANARY_PROMPT],
                "sampling_params": {"max_new_tokens": CANARY_TOKENS, "temperature": 0, "ignore_eos": True}}
        request = PdRequest("/generate", f"canary-{worker.worker_id}", body, check_generate(body),
                            time.monotonic(), CANARY_TIMEOUT)
        request.start_attempt(prefill)
        try:
            async with asyncio.timeout(CANARY_TIMEOUT):
                answer = await Attempt(self._dispatcher_ref(), request, Choice(prefill, decode)).answer()
            if not isinstance(answer, Answer) or answer.status != 200:
                raise ValueError(f"status {answer.status}")
            return list(orjson.loads(answer.body)["output_ids"])
        except (*HALF_ERRORS, TimeoutError, ValueError, KeyError, TypeError) as exc:  # a timed-out canary too
            self._retry_at[worker] = time.monotonic() + RETRY_AFTER
            self.metrics.admissions.labels(worker.role.value, "error").inc()
            log.warning("admission canary could not run; trying again", extra={
                "worker": worker.worker_id, "partner": partner.worker_id,
                "error": getattr(exc, "message", None) or repr(exc)})
            return None

    def _decide(self, worker: Worker, admission: Admission, why: str) -> None:
        if worker.admission is not Admission.PENDING:
            return
        worker.admission, worker.admission_note = admission, why
        self.metrics.admissions.labels(worker.role.value, admission.value).inc()
        (log.info if admission is Admission.ADMITTED else log.error)(
            f"worker {admission.value}", extra={"worker": worker.worker_id, "role": worker.role.value, "why": why})


def _identity_key(worker: Worker) -> str:
    return worker.identity.model_dump_json() if worker.identity is not None else "static"


def _partner(pool: WorkerPool, worker: Worker, admitted: bool) -> Worker | None:
    """A usable worker of the other role, compatible with `worker`, admitted (or, if not `admitted`, pending)."""
    other = Role.DECODE if worker.role is Role.PREFILL else Role.PREFILL
    wanted = Admission.ADMITTED if admitted else Admission.PENDING
    for candidate in pool.of_role(other):
        if candidate.admission is wanted and candidate.compatible_with(worker) and not candidate.unusable(
                ignore_admission=True):
            return candidate
    return None


def _trusted_pair(pool: WorkerPool, key: str) -> tuple[Worker, Worker] | None:
    """An admitted, usable prefill and decode of this model identity."""
    for prefill in pool.of_role(Role.PREFILL):
        if prefill.admission is Admission.ADMITTED and _identity_key(prefill) == key and not prefill.unusable():
            decode = _partner(pool, prefill, admitted=True)
            if decode is not None:
                return prefill, decode
    return None
