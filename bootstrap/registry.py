"""The registry: who is registered, alive and pairable. A version number moves on every change so that the router
can long-poll for the next one instead of polling on a timer."""

from __future__ import annotations

import asyncio
import contextlib
import time

from bootstrap import switch as flips
from pdcluster.common.protocol import Heartbeat, Role, RoleSwitch, WorkerListing, WorkerRegistration, WorkerStatus


def incompatibility(worker: WorkerRegistration, others: list[WorkerRegistration]) -> str:
    """Why `worker` can be paired with none of `others` (workers of the other role); empty when it can, or when
    there is nobody to compare with yet."""
    if not others or any(o.identity == worker.identity for o in others):
        return ""
    peer = others[0].identity
    mine = worker.identity
    diffs = [
        f"{name} {getattr(mine, name)!r} vs {getattr(peer, name)!r}"
        for name in ("model_path", "served_model_name", "page_size", "kv_cache_dtype", "transfer_backend")
        if getattr(mine, name) != getattr(peer, name)
    ]
    return f"no compatible {others[0].role.value}: " + "; ".join(diffs)


class Refused(Exception):
    """A registration the service will not take; the message says why (never anything secret)."""


def kv_secret_conflict(worker: WorkerRegistration, live: list[WorkerRegistration]) -> str:
    """Why `worker` may not join its KV namespace beside the `live` workers (the others registered): their proofs of
    the cluster secret differ, so each would take the other's pages for damaged ones, recompute every hit and remove
    them. Empty when it may: no KV store, a namespace nobody else holds, or the same proof."""
    mine = worker.kv_store
    if mine is None:
        return ""
    differing = [o for o in live if o.kv_store is not None and o.kv_store.namespace == mine.namespace
                 and o.kv_store.secret_proof != mine.secret_proof]
    if not differing:
        return ""
    others = f"the other workers of KV namespace {mine.namespace} ({', '.join(sorted(o.worker_id for o in differing))})"
    if mine.secret_proof is None:
        problem = f"no kv secret is set, but {others} have one"
    elif all(o.kv_store and o.kv_store.secret_proof is None for o in differing):
        problem = f"a kv secret is set, but {others} have none"
    else:
        problem = f"kv secret differs from {others}"
    return (f"{problem}: each would take the other's pages for damaged ones. Give every worker of the namespace the "
            f"same kv_store.secret_file or $PDCLUSTER_KV_SECRET (or none), or stop the others first")


class Registry:
    def __init__(self, ttl_seconds: float):
        self.ttl = ttl_seconds
        self.started = time.time()
        self.version = int(self.started * 1000)
        self._workers: dict[str, WorkerStatus] = {}
        self._draining: set[str] = set()  # worker ids an operator took out of the pools (kept across re-registering)
        self._switches: dict[str, RoleSwitch] = {}  # each worker's last role flip (bootstrap/switch.py)
        self._changed = asyncio.Condition()

    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def register(self, registration: WorkerRegistration) -> WorkerStatus:
        """Refused when its KV secret differs from that of its namespace's listed workers (until they leave or
        expire); its own earlier entry does not count: a restart may change the secret of a worker alone there."""
        others = [s.registration for wid, s in self._workers.items() if wid != registration.worker_id]
        if conflict := kv_secret_conflict(registration, others):
            raise Refused(conflict)
        now = time.time()
        previous = self._workers.get(registration.worker_id)
        self._workers[registration.worker_id] = WorkerStatus(
            registration=registration, healthy=True, registered_at=previous.registered_at if previous else now,
            last_heartbeat=now,
        )
        flip = self._switches.get(registration.worker_id)
        if flip is not None and flips.running(flip) and registration.role is flip.to:
            self._switches[registration.worker_id] = flips.advanced(flip, "done")  # re-registered: the flip is over
        await self._bump()
        return next(row for row in self.listing().workers if row.registration.worker_id == registration.worker_id)

    async def heartbeat(self, worker_id: str, beat: Heartbeat) -> bool:
        status = self._workers.get(worker_id)
        if status is None:
            return False
        changed = status.healthy != beat.healthy or status.detail != beat.detail
        status.healthy, status.detail, status.last_heartbeat = beat.healthy, beat.detail, time.time()
        if changed:
            await self._bump()
        return True

    async def set_draining(self, worker_id: str, draining: bool) -> bool:
        """Take a registered worker out of the routers' pools (or put it back); False if it is not registered."""
        if worker_id not in self._workers:
            return False
        if (worker_id in self._draining) != draining:
            (self._draining.add if draining else self._draining.discard)(worker_id)
            await self._bump()
        return True

    async def deregister(self, worker_id: str) -> bool:
        if self._workers.pop(worker_id, None) is None:
            return False
        self._end_flip(worker_id, "the worker left the registry during the flip")
        await self._bump()
        return True

    async def request_switch(self, worker_id: str, to: Role) -> RoleSwitch | None:
        """Start flipping `worker_id` to `to` (it drains at once); None if it is not registered. Raises
        flips.SwitchRefused, changing nothing, when it may not flip now."""
        if worker_id not in self._workers:
            return None
        flips.check_switch(worker_id, to, self._workers, self._switches, self._draining)
        self._switches[worker_id] = flips.begin(to)
        await self._bump()
        return self._switches[worker_id]

    def switch_order(self, worker_id: str) -> RoleSwitch | None:
        """The flip `worker_id`'s launcher is to carry out (its heartbeat's answer says it), if one is running."""
        flip = self._switches.get(worker_id)
        return flip if flips.running(flip) else None

    async def switch_progress(self, worker_id: str, state: str, reason: str) -> bool:
        """Its launcher says how far the flip got (switching, or failed and why); False if none is running."""
        flip = self._switches.get(worker_id)
        if flip is None or not flips.running(flip):
            return False
        self._switches[worker_id] = flips.advanced(flip, state, reason)
        await self._bump()
        return True

    def _end_flip(self, worker_id: str, reason: str) -> None:
        flip = self._switches.get(worker_id)
        if flip is not None and flips.running(flip):
            self._switches[worker_id] = flips.advanced(flip, "failed", reason)

    def forgive(self, seconds: float) -> None:
        """Time during which this service did not run (a stopped or starved process) counts against no worker: their
        heartbeats of that time wait, unread, in its sockets."""
        for status in self._workers.values():
            status.last_heartbeat += seconds

    async def expire(self) -> None:
        cutoff = time.time() - self.ttl
        dead = [wid for wid, status in self._workers.items() if status.last_heartbeat < cutoff]
        for wid in dead:
            del self._workers[wid]
            self._end_flip(wid, "the worker's heartbeats stopped during the flip")
        overdue = [wid for wid, flip in self._switches.items() if flips.overdue(flip, time.time())]
        for wid in overdue:
            self._end_flip(wid, f"its launcher did not end the flip within {flips.SWITCH_DEADLINE:.0f}s")
        if dead or overdue:
            await self._bump()

    def listing(self, role: Role | None = None, model: str | None = None) -> WorkerListing:
        regs = [s.registration for s in self._workers.values()]
        rows = []
        for status in self._workers.values():
            reg = status.registration
            others = [o for o in regs if o.role is not reg.role]
            flip = self._switches.get(reg.worker_id)
            row = status.model_copy(update={"incompatible": incompatibility(reg, others), "switch": flip,
                                            "draining": reg.worker_id in self._draining or flips.running(flip)})
            if (role is None or reg.role is role) and (model is None or model in (
                    reg.identity.served_model_name, reg.identity.model_path)):
                rows.append(row)
        return WorkerListing(version=self.version, ttl_seconds=self.ttl, uptime_seconds=time.time() - self.started,
                             workers=rows)

    async def wait_for_change(self, since_version: int, timeout: float) -> None:
        async with self._changed:
            if self.version != since_version:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
