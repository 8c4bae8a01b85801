"""Liveness: watch that every worker still answers at all, apart from its /health (router/health.py).

A cheap probe: GET /v1/loads, which SGLang's HTTP process answers from the load snapshot its scheduler publishes in
shared memory (no round trip to the scheduler).
- No answer for `liveness_timeout` seconds: the worker is hung (stopped, swapping, wedged event loop).
- It answers, but our /health has been waiting for `stall_timeout` seconds and the scheduler's snapshot has not
  moved meanwhile: its scheduler is stuck. /health returns as soon as the scheduler outputs anything (any request's
  token, or the probe's own), and a working scheduler publishes a snapshot after every prefill batch and every 15
  decode steps; a long prefill or a long queue moves one or the other.
A hung worker is ejected at once and every exchange the data plane has open with it is ended (router/upstream
connections dropped): a request not yet answered is retried on another pair, a started stream ends with an SSE
error event. It is readmitted as soon as it answers again with a moving snapshot. Thresholds: docs/faults.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from router.config import RouterConfig
from router.upstream import ConnectionDropped, UpstreamClient
from router.workers import Worker, WorkerPool

log = logging.getLogger("pdcluster.router")

LIVENESS_PATH = "/v1/loads"
LIVENESS_PARAMS = {"include": "core"}


def read_snapshot(payload: object) -> tuple | None:
    """The publish stamps of a /v1/loads answer's snapshots (one per DP rank); None if it is not one (a worker
    without /v1/loads is still judged by whether it answers)."""
    try:
        stamps = tuple(float(load["timestamp"]) for load in payload["loads"])
    except (TypeError, KeyError, ValueError):
        return None
    return stamps or None


@dataclass(eq=False)
class Liveness:
    """What the router has seen of one worker's liveness, on its own clock (time.monotonic)."""

    last_answer: float  # the last answer to a liveness probe (or when watching began)
    last_progress: float  # the last time the scheduler's snapshot moved (or when watching began)
    stamps: tuple | None = None
    waiting_since: float | None = None  # our /health has had no 200 since then (None: its last one was a 200)
    reason: str = ""  # why it is hung, "" while it is live
    task: asyncio.Task | None = None

    def answered(self, now: float, stamps: tuple | None) -> None:
        self.last_answer = now
        if stamps is not None and stamps != self.stamps:
            self.stamps, self.last_progress = stamps, now

    def health_sent(self, now: float) -> None:
        if self.waiting_since is None:
            self.waiting_since = now

    def health_answered(self) -> None:
        self.waiting_since = None

    def shift(self, seconds: float) -> None:
        """Time during which the router itself did not run counts against no worker."""
        self.last_answer += seconds
        self.last_progress += seconds
        if self.waiting_since is not None:
            self.waiting_since += seconds

    def verdict(self, now: float, config: RouterConfig) -> str:
        """Why the worker is hung, or "" if it is live."""
        silent = now - self.last_answer
        if silent > config.liveness_timeout:
            return f"no answer to liveness probes for {silent:.1f}s"
        if self.waiting_since is not None:
            stalled = now - max(self.waiting_since, self.last_progress)
            if stalled > config.stall_timeout:
                return f"scheduler made no progress for {stalled:.1f}s (/health waiting, load snapshot still)"
        return ""


class LivenessWatch:
    """Probe every worker's liveness endpoint each liveness_interval and act on the verdicts. Workers that left the
    pool are watched for as long as requests of ours are still open on them (a hung worker also misses its
    heartbeats and drops out of the registry, its requests with it)."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient,
                 upstream: UpstreamClient | None, clock: Callable[[], float] = time.monotonic):
        self.config, self.pool, self.client, self.upstream, self.clock = config, pool, client, upstream, clock
        self.states: dict[Worker, Liveness] = {}
        self._last_tick: float | None = None

    def state(self, worker: Worker) -> Liveness:
        live = self.states.get(worker)
        if live is None:
            now = self.clock()
            live = self.states[worker] = Liveness(last_answer=now, last_progress=now)
        return live

    async def run(self) -> None:
        try:
            while True:
                self.tick()
                await asyncio.sleep(self.config.liveness_interval)
        finally:
            for live in self.states.values():
                if live.task is not None:
                    live.task.cancel()

    def tick(self) -> None:
        now = self.clock()
        if self._last_tick is not None:
            lag = now - self._last_tick - self.config.liveness_interval
            if lag > 1.0:  # this router did not run (a blocked event loop, a stopped process): no worker's fault
                for live in self.states.values():
                    live.shift(lag)
                log.warning("liveness: the router itself stalled; not counted against workers",
                            extra={"seconds": round(lag, 1)})
        self._last_tick = now
        in_pool = set(self.pool.workers.values())
        for worker in list(self.states):
            if worker not in in_pool and worker.in_flight <= 0:
                live = self.states.pop(worker)
                if live.task is not None:
                    live.task.cancel()
        for worker in in_pool | set(self.states):
            live = self.state(worker)
            if live.task is None or live.task.done():
                live.task = asyncio.create_task(self._probe(worker, live))
            self.judge(worker, live)

    async def _probe(self, worker: Worker, live: Liveness) -> None:
        try:
            response = await self.client.get(f"{worker.url}{LIVENESS_PATH}", params=LIVENESS_PARAMS,
                                             timeout=self.config.liveness_timeout)
        except httpx.HTTPError:
            return
        stamps = None
        if response.status_code == 200:
            try:
                stamps = read_snapshot(response.json())
            except ValueError:
                pass
        live.answered(self.clock(), stamps)
        self.judge(worker, live)  # readmit at once, not at the next tick

    def judge(self, worker: Worker, live: Liveness) -> None:
        reason = live.verdict(self.clock(), self.config)
        if reason:
            if worker.alive:
                worker.alive = False
                log.warning("worker hung: ejected", extra={"role": worker.role.value, "worker": worker.url,
                                                           "reason": reason, "in_flight": worker.in_flight})
            live.reason = reason
            if worker.in_flight > 0 and self.upstream is not None:
                # A request not yet answered is retried on another pair, a started stream ends with an error event.
                why = ConnectionDropped(f"{worker.role.value} {worker.worker_id} stopped answering: {reason}")
                ended = self.upstream.end_exchanges(worker.url, why)
                if ended:
                    log.warning("requests on a hung worker ended", extra={"worker": worker.url, "ended": ended})
        elif not worker.alive:
            worker.alive = True
            log.warning("worker answering again: readmitted", extra={"role": worker.role.value, "worker": worker.url,
                                                                    "was": live.reason})
            live.reason = ""
