"""Liveness: watch that every worker still answers at all, apart from its /health (router/fleet/health.py).

A cheap probe: GET /v1/loads, which SGLang's HTTP process answers from the load snapshot its scheduler publishes in
shared memory (no round trip to the scheduler).
- No answer for `liveness_timeout` seconds: the worker is hung (stopped, swapping, wedged event loop).
- It answers, but our /health has been waiting and the scheduler's snapshot has not moved for longer than the
  worker's allowance: its scheduler is stuck. /health returns as soon as the scheduler outputs anything (any
  request's token, or the probe's own), and a working scheduler publishes a snapshot after every batch it runs (a
  prefill batch at once, decode steps every 15). What neither can show is one long forward pass: a 3000-token prompt
  of a real model takes 15 s on a laptop CPU, in silence. So the allowance is `stall_timeout` plus the time one
  forward pass may take (its tokens at the worker's own measured prefill cost per token, which SGLang publishes,
  times SAFETY). For a prefill those tokens are its largest forward pass (its chunked prefill size, from its
  registration), whatever this router has sent it: routers that share the workers (the chart runs two) cannot see
  each other's prompts, and one router's long prompts kept another's /health waiting past stall_timeout
  (bench.cluster on SmolLM2 ejected healthy prefills 14 times in 6 minutes). Between two forward passes the
  snapshot moves, so one pass is the most a working scheduler is silent. Otherwise (a decode; a static worker that
  did not say) the prompts of its requests whose prefill half has not answered: a decode waiting for their KV
  (its pool reserved for them) can keep /health waiting as long (n = 4 fan-outs on SmolLM2 ejected a healthy one).
  And whatever the role, a working scheduler may stay as silent as it was between its snapshots while busy (SAFETY x
  the longest of its last BUSY_GAPS such gaps): a decode publishes every 15 steps, and with ~1 s steps (SmolLM2,
  unpinned workers on 2 busy cores) a healthy decode was ejected at 6 s with 6 streams on it (bench.cluster).
A hung worker is ejected at once and every exchange the data plane has open with it is ended (router/upstream
connections dropped): a request not yet answered is retried on another pair, a started stream ends with an SSE
error event. It is readmitted as soon as it answers again with a moving snapshot. Thresholds: docs/faults.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdcluster.common.protocol import Role
from router.config import RouterConfig
from router.fleet.workers import Worker, WorkerPool
from router.transport.upstream import ConnectionDropped, UpstreamClient

log = logging.getLogger("pdcluster.router")

LIVENESS_PATH = "/v1/loads"
LIVENESS_PARAMS = {"include": "core"}


# Until a worker has prefilled MIN_RATE_TOKENS tokens, its cost per prompt token is taken to be this (seconds): a
# real model on a slow CPU (SmolLM2: ~0.005 s a token on 2 cores; larger models more).
DEFAULT_SECONDS_PER_TOKEN = 0.02
MIN_RATE_TOKENS = 256
# Long prompts cost more per token than the average (attention grows with the length), and a busy machine slows
# every forward pass: the estimate is multiplied by this before a silent worker is judged stuck.
SAFETY = 3.0
# How many of a worker's latest gaps between snapshots while busy its allowance remembers: a few publish intervals,
# so one slow stretch (a burst of load) widens it for a while and then lets go.
BUSY_GAPS = 8


def read_prefill_totals(payload: Any) -> tuple[float, int] | None:
    """(microseconds spent prefilling, uncached prompt tokens prefilled), summed over ranks, from /v1/loads; None if
    the worker does not publish them."""
    try:
        loads = payload["loads"]
        return (float(sum(load["total_prefill_busy_us"] for load in loads)),
                int(sum(load["total_prefill_uncached_tokens"] for load in loads)))
    except (TypeError, KeyError, ValueError):
        return None


def read_snapshot(payload: Any) -> tuple | None:
    """The publish stamps of a /v1/loads answer's snapshots (one per DP rank); None if it is not one (a worker
    without /v1/loads is still judged by whether it answers)."""
    try:
        stamps = tuple(float(load["timestamp"]) for load in payload["loads"])
    except (TypeError, KeyError, ValueError):
        return None
    return stamps or None


def read_running(payload: Any) -> int | None:
    """The requests a /v1/loads answer says are running (summed over ranks), or None."""
    try:
        return int(sum(load["num_running_reqs"] for load in payload["loads"]))
    except (TypeError, KeyError, ValueError):
        return None


@dataclass(eq=False)
class Liveness:
    """What the router has seen of one worker's liveness, on its own clock (time.monotonic)."""

    last_answer: float  # the last answer to a liveness probe (or when watching began)
    last_progress: float  # the last time the scheduler's snapshot moved (or when watching began)
    stamps: tuple | None = None
    waiting_since: float | None = None  # our /health has had no answer since then (None: its last one answered)
    reason: str = ""  # why it is hung, "" while it is live
    task: asyncio.Task | None = None
    seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN  # the worker's own prefill cost, once it has enough of it
    running: bool = False  # its latest snapshot showed requests running
    busy_gaps: deque = field(default_factory=lambda: deque(maxlen=BUSY_GAPS))  # seconds between snapshots, busy
    _totals: tuple[float, int] | None = None

    def answered(self, now: float, stamps: tuple | None, totals: tuple[float, int] | None = None,
                 running: int | None = None) -> None:
        self.last_answer = now
        if stamps is not None and stamps != self.stamps:
            # A gap that ended while it was judged hung is not a working scheduler's (SIGSTOP, a wedge).
            if self.running and not self.reason and self.stamps is not None:
                self.busy_gaps.append(now - self.last_progress)
            self.stamps, self.last_progress = stamps, now
            if running is not None:
                self.running = running > 0
        if totals is not None and totals != self._totals:
            self._totals = totals
            busy_us, tokens = totals
            if tokens >= MIN_RATE_TOKENS:
                self.seconds_per_token = busy_us / 1e6 / tokens

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

    @property
    def busy_gap(self) -> float:
        return max(self.busy_gaps, default=0.0)

    def allowance(self, config: RouterConfig, pending_tokens: int) -> float:
        """How long the scheduler may be silent: stall_timeout, plus what a forward pass of `pending_tokens` prompt
        tokens may take or, if longer, what it was seen to take between snapshots while busy."""
        forward = self.seconds_per_token * max(0, pending_tokens)
        return config.stall_timeout + SAFETY * max(forward, self.busy_gap)

    def verdict(self, now: float, config: RouterConfig, pending_tokens: int = 0, shutting_down: bool = False) -> str:
        """Why the worker is hung, or "" if it is live. `pending_tokens`: the prompt tokens a forward pass in
        progress may hold (silent_tokens). `shutting_down`: it left the registry with requests of ours still open
        (its launcher deregisters it on SIGTERM, and SGLang drains): only silence counts then, not a still snapshot
        with /health waiting, which a draining SGLang shows between its last steps (seen under `docker stop`); its
        orchestrator's grace period bounds the drain."""
        silent = now - self.last_answer
        if silent > config.liveness_timeout:
            return f"no answer to liveness probes for {silent:.1f}s"
        if self.waiting_since is not None and not shutting_down:
            stalled = now - max(self.waiting_since, self.last_progress)
            allowed = self.allowance(config, pending_tokens)
            if stalled > allowed:
                return (f"scheduler made no progress for {stalled:.1f}s (/health waiting, load snapshot still; "
                        f"allowed {allowed:.1f}s for a forward pass of up to ~{pending_tokens} prompt tokens, or "
                        f"{SAFETY:g}x its longest gap between snapshots while busy, {self.busy_gap:.1f}s)")
        return ""


def silent_tokens(worker: Worker) -> int:
    """The prompt tokens a forward pass in progress on `worker` may hold (see the module's docstring)."""
    if worker.role is Role.PREFILL and worker.forward_tokens is not None:
        return worker.forward_tokens
    return worker.pending_prompt_tokens


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
        stamps = totals = running = None
        if response.status_code == 200:
            try:
                payload = response.json()
            except ValueError:
                payload = None
            stamps, totals, running = read_snapshot(payload), read_prefill_totals(payload), read_running(payload)
        live.answered(self.clock(), stamps, totals, running)
        self.judge(worker, live)  # readmit at once, not at the next tick

    def judge(self, worker: Worker, live: Liveness) -> None:
        shutting_down = self.pool.workers.get(worker.worker_id) is not worker
        reason = live.verdict(self.clock(), self.config, silent_tokens(worker), shutting_down)
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
