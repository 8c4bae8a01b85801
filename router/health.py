"""Keep the pool's health true: follow the bootstrap service's registry, probe every worker's /health, and watch
that every worker still answers at all (liveness).

Discovery long-polls the registry (`wait_version`), so a new or dead worker shows up within a fraction of a second.
While the bootstrap service is down, the last known set stays in service.

SGLang's /health runs a real one-token generation: >= 1 s, longer under load, and it gives up only after 20 s, so
it cannot tell "slow" from "hung" quickly. Liveness is a second, cheap probe: GET /v1/loads, which SGLang's HTTP
process answers from the load snapshot its scheduler publishes in shared memory (no round trip to the scheduler).
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

from pdcluster.protocol import WorkerListing
from router.config import RouterConfig
from router.upstream import ConnectionDropped
from router.workers import Worker, WorkerPool

log = logging.getLogger("pdcluster.router")


async def follow_registry(config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient) -> None:
    version: int | None = None
    warming_up = False
    headers = {"Authorization": f"Bearer {config.bootstrap_token}"} if config.bootstrap_token else {}
    while True:
        params: dict = {"timeout": 10.0}
        if version is not None and not warming_up:
            params["wait_version"] = version
        try:
            response = await client.get(f"{config.bootstrap_url}/v1/workers", params=params, headers=headers,
                                        timeout=httpx.Timeout(5.0, read=15.0))
            response.raise_for_status()
            listing = WorkerListing.model_validate(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            if version is not None:
                log.warning("bootstrap service unreachable; serving the last known workers",
                            extra={"error": type(exc).__name__, "workers": len(pool.workers)})
            version = None
            await asyncio.sleep(1.0)
            continue
        warming_up = listing.warming_up
        if listing.version != version or warming_up:
            # A young registry has not heard from every live worker yet: add, but don't drop, until it has.
            pool.sync_discovered(listing.workers, remove_missing=not warming_up)
        version = listing.version
        if warming_up:
            await asyncio.sleep(0.2)


async def probe(worker: Worker, client: httpx.AsyncClient, config: RouterConfig,
                liveness: Liveness | None = None) -> None:
    if liveness is not None:
        liveness.health_sent(time.monotonic())
    try:
        response = await client.get(f"{worker.url}/health", timeout=config.health_timeout)
        ok = response.status_code == 200
    except httpx.HTTPError:
        ok = False
    if liveness is not None and ok:
        liveness.health_answered()
    if ok:
        if not worker.probe_healthy:
            log.warning("worker readmitted", extra={"role": worker.role.value, "worker": worker.url})
        worker.probe_healthy, worker.failed_probes = True, 0
        worker.breaker.on_probe_success()  # SGLang's /health generates a token: as good a trial as a request
    else:
        mark_failed(worker, config.unhealthy_threshold)


def mark_failed(worker: Worker, threshold: int) -> None:
    worker.failed_probes += 1
    if worker.failed_probes >= threshold and worker.probe_healthy:
        worker.probe_healthy = False
        log.warning("worker ejected", extra={"role": worker.role.value, "worker": worker.url,
                                             "failed_checks": worker.failed_probes})


async def probe_forever(config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient,
                        upstream: object | None = None) -> None:
    """Probe every worker each health_interval; a slow probe (SGLang's /health generates a token) delays only its
    own worker's next probe, never the others'. Liveness (see the module's docstring) runs beside it; `upstream`
    is the data plane's client, whose exchanges with a hung worker are ended."""
    running: dict[str, asyncio.Task] = {}
    watch = LivenessWatch(config, pool, client, upstream)
    liveness = asyncio.create_task(watch.run())
    try:
        while True:
            for worker in list(pool.workers.values()):
                task = running.get(worker.worker_id)
                if task is None or task.done():
                    running[worker.worker_id] = asyncio.create_task(
                        probe(worker, client, config, watch.state(worker)))
            for gone in [wid for wid in running if wid not in pool.workers]:
                running.pop(gone).cancel()
            await asyncio.sleep(config.health_interval)
    finally:
        liveness.cancel()
        for task in running.values():
            task.cancel()


# ----- liveness -----

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


def end_exchanges(upstream: object | None, worker: Worker, why: str) -> int:
    """Drop every connection the data plane has open with `worker` with a request on it: the dispatcher then
    retries a request not yet answered on another pair, and ends a started stream with an SSE error event."""
    if upstream is None:
        return 0
    try:
        address = upstream._address(worker.url)[:2]
    except Exception:  # noqa: BLE001 - a URL the data plane cannot speak to has nothing open
        return 0
    ended = 0
    for conn in list(getattr(upstream, "_open", ())):
        response = conn.response
        if conn.key == address and response is not None and not response.done:
            response.interrupt(ConnectionDropped(f"{worker.role.value} {worker.worker_id} stopped answering: {why}"))
            ended += 1
    return ended


class LivenessWatch:
    """Probe every worker's liveness endpoint each liveness_interval and act on the verdicts. Workers that left the
    pool are watched for as long as requests of ours are still open on them (a hung worker also misses its
    heartbeats and drops out of the registry, its requests with it)."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient, upstream: object | None,
                 clock: Callable[[], float] = time.monotonic):
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
            if worker.in_flight > 0:
                ended = end_exchanges(self.upstream, worker, reason)
                if ended:
                    log.warning("requests on a hung worker ended", extra={"worker": worker.url, "ended": ended})
        elif not worker.alive:
            worker.alive = True
            log.warning("worker answering again: readmitted", extra={"role": worker.role.value, "worker": worker.url,
                                                                    "was": live.reason})
            live.reason = ""
