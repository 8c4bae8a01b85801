"""The router's view of its workers: where they are, whether they are healthy, how busy they are, and each one's
circuit breaker. It imports nothing of the router's: every other module may use it.

The circuit breaker, one per worker: after `threshold` consecutive failures a worker gets no traffic for `cooldown`
seconds, then one trial request (half-open); its success closes the breaker, its failure opens it again.

Every attempt ends in `on_end`, whatever became of it (a 4xx, a client that left, a timeout, the other half's
failure): a trial that proved nothing frees the slot for the next one instead of keeping the worker out for good.
A successful health probe after the cooldown counts as a successful trial.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from pdcluster.common.protocol import (
    KVEventsEndpoint,
    KVStoreMembership,
    ModelIdentity,
    Role,
    WorkerCapabilities,
    WorkerRegistration,
    WorkerStatus,
)

log = logging.getLogger("pdcluster.router")


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, threshold: int = 5, cooldown: float = 10.0, clock=time.monotonic):
        self.threshold, self.cooldown, self._clock = threshold, cooldown, clock
        self.failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.cooldown:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def on_attempt(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def on_success(self) -> None:
        self.failures, self._opened_at, self._trial_in_flight = 0, None, False

    def on_failure(self) -> None:
        self.failures += 1
        self._trial_in_flight = False
        if self.failures >= self.threshold or self._opened_at is not None:
            self._opened_at = self._clock()

    def on_end(self) -> None:
        """The attempt is over; if it settled nothing, the next request may be the trial."""
        self._trial_in_flight = False

    def on_probe_success(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.on_success()



class Admission(StrEnum):
    """Whether a worker instance passed its admission canary (router/pd/admission.py)."""

    PENDING = "pending"
    ADMITTED = "admitted"
    REFUSED = "refused"


@dataclass(eq=False)
class Worker:
    worker_id: str
    role: Role
    url: str
    # A prefill's SGLang KV bootstrap server (what its decode fetches KV metadata from; SGLang's bootstrap_host/port).
    kv_bootstrap_host: str | None = None
    kv_bootstrap_port: int | None = None
    identity: ModelIdentity | None = None  # None for static workers: compatible with anything
    vocab_size: int | None = None  # token ids must be below it
    context_length: int | None = None
    # a decode whose KV pool cannot take every prompt: the longest (router/pd/kv_fit.py)
    prompt_budget: int | None = None
    forward_tokens: int | None = None  # the most prompt tokens one forward pass computes (router/fleet/liveness.py)
    static: bool = False
    # The worker's own launcher reports SGLang's health through the registry; the router checks too.
    registry_healthy: bool = True
    probe_healthy: bool = True
    # answers the router's liveness probe and its scheduler makes progress (router/fleet/liveness.py)
    alive: bool = True
    failed_probes: int = 0
    in_flight: int = 0
    # Prompt tokens (estimated) of the prefill halves not yet answered of this worker's requests: on a prefill, how
    # long a forward pass may take; on a decode, the KV it still awaits, during which a full pool can keep its /health
    # waiting; either way, before its silence means a stuck scheduler (router/fleet/liveness.py).
    pending_prompt_tokens: int = 0
    # Of those, the ones it will compute, not hold (what cache_aware predicted): the queue a new request waits behind.
    pending_work_tokens: int = 0
    # A prefill's measured rate: prompt tokens computed per second (an EWMA over its answered prefill halves), the
    # samples taken, when the last half ended, and the tokens and busy seconds not yet in a sample
    # (router/admission/queue_wait.py). A restarted worker is measured anew.
    prefill_rate: float = 0.0
    prefill_rate_samples: int = 0
    prefill_busy_until: float = 0.0
    prefill_unsampled_tokens: int = 0
    prefill_unsampled_seconds: float = 0.0
    incompatible: str = ""
    draining: bool = False  # taken out of the pool by an operator (the registry says so): finishes, takes nothing new
    instance_id: str | None = None  # its launcher's: a restarted worker is a new instance, admitted anew
    admission: Admission = Admission.ADMITTED  # the pool sets PENDING on the workers it adds (admission_check)
    admission_note: str = ""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    # What its SGLang runs with that some requests need on both workers of their pair (router/pd/pairing.py).
    capabilities: WorkerCapabilities = field(default_factory=WorkerCapabilities)
    # where its SGLang publishes its KV events (router/kv_routing/kv_events.py)
    kv_events: KVEventsEndpoint | None = None
    # the KV store on disk it reads and writes (router/kv_routing/kv_index.py)
    kv_store: KVStoreMembership | None = None

    def book(self, prompt_tokens: int, work_tokens: int) -> None:
        """A prefill half's prompt on (positive) or off (negative) this worker's books."""
        self.pending_prompt_tokens += prompt_tokens
        self.pending_work_tokens += work_tokens

    @property
    def healthy(self) -> bool:
        return self.registry_healthy and self.probe_healthy and self.alive

    def unusable(self, ignore_admission: bool = False) -> str:
        """Why this worker gets no new request now, or "" if it may. The one place where that is decided; its
        inputs are kept by admission (router/pd/admission.py), the registry (registry_healthy, draining), the health
        probes (probe_healthy), liveness (alive) and the circuit breaker."""
        if not ignore_admission and self.admission is not Admission.ADMITTED:
            return ("awaiting its admission canary" if self.admission is Admission.PENDING
                    else f"refused at admission: {self.admission_note}")
        if self.draining:
            return "draining (taken out of the pool by an operator: python -m bootstrap resume puts it back)"
        if not self.registry_healthy:
            return "unhealthy in the registry (its launcher's health check)"
        if not self.probe_healthy:
            return f"failed {self.failed_probes} health checks of the router"
        if not self.alive:
            return "hung (liveness)"
        if not self.breaker.allows():
            return f"circuit breaker {self.breaker.state.name.lower()}"
        return ""

    @classmethod
    def from_registration(cls, reg: WorkerRegistration) -> Worker:
        return cls(reg.worker_id, reg.role, reg.base_url, reg.kv_bootstrap_host, reg.kv_bootstrap_port, reg.identity,
                   reg.vocab_size, reg.context_length, reg.prompt_budget, reg.forward_tokens,
                   instance_id=reg.instance_id, capabilities=reg.capabilities, kv_events=reg.kv_events,
                   kv_store=reg.kv_store)

    def registered_as(self) -> tuple:
        """What its registration says: another value under the same id is another worker, or a restarted one."""
        return (self.role, self.url, self.kv_bootstrap_host, self.kv_bootstrap_port, self.identity, self.vocab_size,
                self.context_length, self.prompt_budget, self.forward_tokens, self.instance_id, self.capabilities,
                self.kv_events, self.kv_store)

    def compatible_with(self, other: Worker) -> bool:
        return self.identity is None or other.identity is None or self.identity == other.identity


@dataclass
class WorkerPool:
    workers: dict[str, Worker] = field(default_factory=dict)
    make_breaker: Callable[[], CircuitBreaker] = CircuitBreaker
    # Each new worker instance passes an admission canary before it gets traffic (router/pd/admission.py); False: none.
    admission_check: bool = True
    # Told the id of every worker that leaves the pool (policies forget what they kept about it).
    on_removed: list[Callable[[str], None]] = field(default_factory=list)

    def _add(self, worker: Worker) -> Worker:
        worker.breaker = self.make_breaker()
        worker.admission = Admission.PENDING if self.admission_check else Admission.ADMITTED
        self.workers[worker.worker_id] = worker
        return worker

    def add_static(self, workers: Iterable[Worker]) -> None:
        """Workers listed in the router config (RouterConfig.static_workers)."""
        for worker in workers:
            self._add(worker)

    def sync_discovered(self, rows: list[WorkerStatus], remove_missing: bool = True) -> None:
        """Make the discovered part of the pool equal the registry listing, keeping live counters of known workers.

        With remove_missing=False (a freshly restarted registry) workers are only added or updated."""
        seen = set()
        for row in rows:
            reg = row.registration
            seen.add(reg.worker_id)
            current = self.workers.get(reg.worker_id)
            fresh = Worker.from_registration(reg)
            if current is None or current.registered_as() != fresh.registered_as():
                if current is not None and current.role is not fresh.role:  # a role flip, at the same address: what
                    for listener in self.on_removed:  # the policies kept of it belongs to the role it left
                        listener(reg.worker_id)
                current = self._add(fresh)
            current.registry_healthy = row.healthy
            current.incompatible = row.incompatible
            current.draining = row.draining
        if remove_missing:
            for worker_id in [w.worker_id for w in self.workers.values() if not w.static and w.worker_id not in seen]:
                del self.workers[worker_id]
                for listener in self.on_removed:
                    listener(worker_id)

    def of_role(self, role: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role is role]

    def healthy(self, role: Role) -> list[Worker]:
        """Admitted, healthy and not draining: what can serve (a breaker that opened on a blip does not make a router
        unready)."""
        return [w for w in self.of_role(role) if w.healthy and not w.draining and w.admission is Admission.ADMITTED]

    def readiness(self) -> tuple[bool, str]:
        prefills, decodes = self.healthy(Role.PREFILL), self.healthy(Role.DECODE)
        if not prefills or not decodes:
            return False, f"healthy workers: {len(prefills)} prefill, {len(decodes)} decode; need one of each"
        if not any(p.compatible_with(d) for p in prefills for d in decodes):
            reasons = "; ".join(sorted({w.incompatible for w in prefills + decodes if w.incompatible}))
            return False, f"no compatible prefill/decode pair: {reasons or 'model identities differ'}"
        return True, f"{len(prefills)} prefill, {len(decodes)} decode healthy"


def mark_failed(worker: Worker, threshold: int) -> None:
    """A failed health check, or (threshold 1) a connection the worker refused or dropped: out of rotation after
    `threshold` in a row, until a probe succeeds."""
    worker.failed_probes += 1
    if worker.failed_probes >= threshold and worker.probe_healthy:
        worker.probe_healthy = False
        log.warning("worker ejected", extra={"role": worker.role.value, "worker": worker.url,
                                             "failed_checks": worker.failed_probes})
