"""Admission by predicted wait: a request goes to a pair only if the prefill wait predicted for it (the least of the
usable prefills', router/admission/queue_wait.py) is within its priority class's bound (router/config.py's
PriorityClass); else it waits in the router's queue, or gets a 429 with Retry-After, before any worker holds anything
for it.

Why: SGLang's decode pre-allocates a request's KV and waits for it at most SGLANG_DISAGGREGATION_WAITING_TIMEOUT
(60 s in the shipped configs); a request sent to a prefill whose queue is longer than that holds decode memory for
nothing and fails late. Every class's bound is at most half of that timeout (AdmissionConfig), so an admitted
request's decode waits for its KV no longer than its prefill's queue explains, with room to spare.

The queue: one per class, served by priority (higher first), weighted fair across tenants within a class and FIFO
within a tenant (router/admission/fair_queue.py); a new request never overtakes one queued in a class at least as
high. Its head leaves when the predicted wait is within its class's bound (checked every TICK); after `queue_wait`
seconds, or when the class's queue is full, the request gets a 429. An admitted request's prompt is reserved (counted
on every prefill's queue) until its prefill half books it (`dispatched`), so that one burst is not admitted whole on a
wait measured before any of it was booked.

Retry-After (whole seconds, at least 1): the time for the prefills to drain the wait over the bound and the tokens
queued ahead in the router, at the sum of the usable prefills' rates.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from pdcluster.common.http import ApiError
from pdcluster.common.protocol import Role
from router.admission.fair_queue import FairQueue
from router.admission.queue_wait import WaitModel
from router.config import AdmissionConfig
from router.fleet.workers import Worker, WorkerPool
from router.metrics import CURRENT_TENANT, RouterMetrics

TICK = 0.05  # seconds between the queue's checks of the predicted wait
DEFAULT_CLASS = "default"


class Refused(ApiError):
    """A 429 (OpenAI's `rate_limit_exceeded`) with the seconds to wait before trying again."""

    def __init__(self, message: str, retry_after: int, reason: str):
        super().__init__(429, message)
        self.retry_after, self.reason = retry_after, reason


@dataclass(eq=False)
class Ticket:
    """An admitted request's prompt tokens, reserved until its prefill half books them."""

    tokens: int
    released: bool = False


@dataclass(eq=False)
class _Waiter:
    klass: str
    tokens: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


_TICKET: ContextVar[Ticket | None] = ContextVar("admission_ticket", default=None)


class Gate:
    """The module's docstring: `admitted` around a request's attempts, `dispatched` once its prefill half booked."""

    def __init__(self, config: AdmissionConfig, pool: WorkerPool, metrics: RouterMetrics, model: WaitModel):
        self.config, self.pool, self.metrics, self.model = config, pool, metrics, model
        self.queues: dict[str, FairQueue[_Waiter]] = {name: FairQueue() for name in config.classes}
        self.order = sorted(config.classes, key=lambda name: -config.classes[name].priority)
        self.reserved = 0  # tokens of requests admitted whose prefill half has not booked them yet
        self._pump: asyncio.Task | None = None

    def _prefills(self) -> list[Worker]:
        return [w for w in self.pool.of_role(Role.PREFILL) if not w.unusable()]

    def predicted_wait(self) -> float:
        """Seconds a request admitted now would wait for the least busy usable prefill (0 with none: pairing says
        why none can serve)."""
        prefills = self._prefills()
        return min((self.model.wait(w, self.reserved) for w in prefills), default=0.0)

    def retry_after(self, klass: str, wait: float) -> int:
        """Whole seconds (>= 1) for the prefills to drain `wait` down to the class's bound, and the tokens queued
        ahead of a new request of the class, at the usable prefills' summed rate."""
        rate = sum(self.model.rate(w) for w in self._prefills())
        priority = self.config.classes[klass].priority
        ahead = sum(w.tokens for name in self.order if self.config.classes[name].priority >= priority
                    for w in self.queues[name])
        over = max(0.0, wait - self.config.classes[klass].max_predicted_wait)
        return max(1, math.ceil(over + (ahead / rate if rate > 0 else 0.0)))

    @contextlib.asynccontextmanager
    async def admitted(self, klass: str, tokens: int, tenant: str = "", weight: float = 1.0) -> AsyncIterator[None]:
        """Within it the request is admitted (it may have waited in the queue); Refused (a 429) if it is not.
        `tenant`, `weight`: its tenant's share of its class's queue (router/admission/tenants.py)."""
        if not self.config.enabled:
            yield
            return
        ticket = await self._admit(klass, tokens, tenant, weight)
        reset = _TICKET.set(ticket)
        try:
            yield
        finally:
            _TICKET.reset(reset)
            self._release(ticket)

    def dispatched(self) -> None:
        """The current request's prefill half booked its prompt: its reservation ends (a fan-out's first choice
        ends it for all)."""
        ticket = _TICKET.get()
        if ticket is not None:
            self._release(ticket)

    def _reserve(self, tokens: int) -> Ticket:
        self.reserved += tokens
        return Ticket(tokens)

    def _release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self.reserved -= ticket.tokens

    def _ahead(self, klass: str) -> bool:
        """Whether a request of the class queued now would be behind one queued already (its class's, or a higher)."""
        priority = self.config.classes[klass].priority
        return any(self.queues[name] for name in self.order if self.config.classes[name].priority >= priority)

    async def _admit(self, klass: str, tokens: int, tenant: str, weight: float) -> Ticket:
        limits = self.config.classes[klass]
        wait = self.predicted_wait()
        self.metrics.predicted_wait.observe(wait)
        if wait <= limits.max_predicted_wait and not self._ahead(klass):
            return self._reserve(tokens)
        queue = self.queues[klass]
        if limits.queue_wait <= 0 or len(queue) >= limits.queue_length:
            reason = "predicted_wait" if limits.queue_wait <= 0 else "queue_full"
            raise self._refusal(klass, wait, reason)
        waiter = _Waiter(klass, tokens)
        queue.append(tenant, weight, tokens, waiter)
        self._queue_changed(klass)
        admitted = False
        try:
            async with asyncio.timeout(limits.queue_wait):
                ticket = await waiter.future
            admitted = True
            return ticket
        except TimeoutError:
            raise self._refusal(klass, self.predicted_wait(), "queue_timeout") from None
        finally:
            if queue.remove(waiter):  # timed out, or the client left
                self._queue_changed(klass)
            elif not admitted and waiter.future.done() and not waiter.future.cancelled():
                self._release(waiter.future.result())  # admitted just as it timed out or was cancelled

    def _refusal(self, klass: str, wait: float, reason: str) -> Refused:
        self.metrics.refusals.labels(klass, reason).inc()
        if (tenant := CURRENT_TENANT.get()) is not None:
            self.metrics.tenant_refusals.labels(tenant, reason).inc()
        bound = self.config.classes[klass].max_predicted_wait
        retry = self.retry_after(klass, wait)
        why = {"predicted_wait": "no queue for its class", "queue_full": "the router's queue for its class is full",
               "queue_timeout": "it waited in the router's queue for as long as its class may"}[reason]
        return Refused(f"the cluster is busy: a new request would wait {wait:.1f}s for a prefill (this class's bound: "
                       f"{bound:g}s), and {why}; retry after {retry}s", retry, reason)

    def _queue_changed(self, klass: str) -> None:
        self.metrics.queue_length.labels(klass).set(len(self.queues[klass]))
        if self.queues[klass] and (self._pump is None or self._pump.done()):
            self._pump = asyncio.create_task(self._serve_queues())

    async def _serve_queues(self) -> None:
        """While requests are queued: every TICK, admit the heads that fit, by priority."""
        while any(self.queues.values()):
            self.admit_heads()
            await asyncio.sleep(TICK)

    def admit_heads(self) -> None:
        """Admit queued requests, highest class first, each class in order, while the next one's wait fits its
        class's bound; the first that does not fit stops it (nothing overtakes it)."""
        for name in self.order:
            queue, bound = self.queues[name], self.config.classes[name].max_predicted_wait
            while queue:
                if self.predicted_wait() > bound:
                    self._queue_changed(name)
                    return
                head = queue.popleft()  # (a waiter that timed out or left removed itself, or is about to:)
                if not head.future.done():  # its wait ran out as its turn came; it answers 429 itself
                    head.future.set_result(self._reserve(head.tokens))
            self._queue_changed(name)

