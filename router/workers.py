"""The router's view of its workers: where they are, whether they are healthy, how busy they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from pdcluster.protocol import ModelIdentity, Role, WorkerRegistration, WorkerStatus
from router.breaker import CircuitBreaker

if TYPE_CHECKING:  # type only: the config checks policy names, and policies import this module
    from router.config import StaticWorker


class Admission(StrEnum):
    """Whether a worker instance passed its admission canary (router/admission.py)."""

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
    prompt_budget: int | None = None  # a decode whose KV pool cannot take every prompt: the longest (router/kv_fit.py)
    forward_tokens: int | None = None  # the most prompt tokens one forward pass computes (router/liveness.py)
    static: bool = False
    # The worker's own launcher reports SGLang's health through the registry; the router checks too.
    registry_healthy: bool = True
    probe_healthy: bool = True
    alive: bool = True  # answers the router's liveness probe and its scheduler makes progress (router/liveness.py)
    failed_probes: int = 0
    in_flight: int = 0
    # Prompt tokens (estimated) of this worker's prefill halves not yet answered: how long a forward pass may take
    # before its silence means a stuck scheduler (router/liveness.py).
    pending_prompt_tokens: int = 0
    incompatible: str = ""
    draining: bool = False  # taken out of the pool by an operator (the registry says so): finishes, takes nothing new
    instance_id: str | None = None  # its launcher's: a restarted worker is a new instance, admitted anew
    admission: Admission = Admission.ADMITTED  # the pool sets PENDING on the workers it adds (admission_check)
    admission_note: str = ""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @property
    def healthy(self) -> bool:
        return self.registry_healthy and self.probe_healthy and self.alive

    def unusable(self, ignore_admission: bool = False) -> str:
        """Why this worker gets no new request now, or "" if it may. The one place where that is decided; its
        inputs are kept by admission (router/admission.py), the registry (registry_healthy, draining), the health
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
    def from_static(cls, role: Role, spec: StaticWorker, index: int) -> Worker:
        url = str(spec.url).rstrip("/")
        host = spec.kv_bootstrap_host or urlparse(url).hostname
        return cls(f"static-{role.value}-{index}", role, url, host if role is Role.PREFILL else None,
                   spec.kv_bootstrap_port, vocab_size=spec.vocab_size, context_length=spec.context_length,
                   forward_tokens=spec.forward_tokens, static=True)

    @classmethod
    def from_registration(cls, reg: WorkerRegistration) -> Worker:
        return cls(reg.worker_id, reg.role, reg.base_url, reg.bootstrap_host, reg.bootstrap_port, reg.identity,
                   reg.vocab_size, reg.context_length, reg.prompt_budget, reg.forward_tokens,
                   instance_id=reg.instance_id)

    def registered_as(self) -> tuple:
        """What its registration says: another value under the same id is another worker, or a restarted one."""
        return (self.role, self.url, self.kv_bootstrap_host, self.kv_bootstrap_port, self.identity, self.vocab_size,
                self.context_length, self.prompt_budget, self.forward_tokens, self.instance_id)

    def compatible_with(self, other: Worker) -> bool:
        return self.identity is None or other.identity is None or self.identity == other.identity


@dataclass
class WorkerPool:
    workers: dict[str, Worker] = field(default_factory=dict)
    make_breaker: Callable[[], CircuitBreaker] = CircuitBreaker
    # Each new worker instance passes an admission canary before it gets traffic (router/admission.py); False: none.
    admission_check: bool = True
    # Told the id of every worker that leaves the pool (policies forget what they kept about it).
    on_removed: list[Callable[[str], None]] = field(default_factory=list)

    def _add(self, worker: Worker) -> Worker:
        worker.breaker = self.make_breaker()
        worker.admission = Admission.PENDING if self.admission_check else Admission.ADMITTED
        self.workers[worker.worker_id] = worker
        return worker

    def add_static(self, role: Role, specs: list[StaticWorker]) -> None:
        for index, spec in enumerate(specs):
            self._add(Worker.from_static(role, spec, index))

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
