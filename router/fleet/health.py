"""Health probes: every worker's /health (each health_interval while it works or is out, each idle_health_interval
while it idles), which ejects a worker after unhealthy_threshold failures in a row and readmits it on one success;
liveness (router/fleet/liveness.py) runs beside them.

SGLang's /health runs a real one-token generation: >= 1 s, longer under load, and it gives up only after 20 s, so
it cannot tell "slow" from "hung" quickly: that is liveness's job.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pdcluster.common import otel
from router.config import RouterConfig
from router.fleet.liveness import Liveness, LivenessWatch
from router.fleet.workers import BreakerState, Worker, WorkerPool, mark_failed
from router.transport.upstream import UpstreamClient

log = logging.getLogger("pdcluster.router")


async def probe(worker: Worker, client: httpx.AsyncClient, config: RouterConfig,
                liveness: Liveness | None = None, traced: bool = False) -> None:
    """`traced` (the router traces requests): the probe carries an unsampled `traceparent`, so that SGLang does not
    trace the generation it runs for it."""
    if liveness is not None:
        liveness.health_sent(time.monotonic())
    try:
        response = await client.get(f"{worker.url}/health", timeout=config.health_timeout,
                                    headers=otel.unsampled() if traced else None)
        ok = response.status_code == 200
        if liveness is not None:
            # Any answer ends the wait, a refusal too: SGLang refuses /health at once while it drains (503), and
            # a draining decode publishing its snapshot only every 15 steps was ejected as stuck mid-stream. A stuck
            # scheduler keeps /health waiting (SGLANG_HEALTH_CHECK_TIMEOUT is 600 s in every worker plan).
            liveness.health_answered()
    except httpx.TimeoutException:
        # Its scheduler is busy or stuck: no verdict here. Liveness judges that, with the time the work in flight on
        # the worker may take (one long prompt can keep SGLang's /health waiting for longer than health_timeout).
        return
    except httpx.HTTPError:
        ok = False
    if ok:
        if not worker.probe_healthy:
            log.warning("worker readmitted", extra={"role": worker.role.value, "worker": worker.url})
        worker.probe_healthy, worker.failed_probes = True, 0
        worker.breaker.on_probe_success()  # SGLang's /health generates a token: as good a trial as a request
    else:
        mark_failed(worker, config.unhealthy_threshold)


def idle(worker: Worker) -> bool:
    """Nothing of ours on it, and nothing a good probe could end (ejected, a breaker not closed): probed seldom."""
    busy = worker.in_flight > 0 or worker.pending_prompt_tokens > 0
    return not busy and worker.healthy and worker.breaker.state is BreakerState.CLOSED


async def probe_forever(config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient,
                        upstream: UpstreamClient | None = None, traced: bool = False) -> None:
    """Probe each worker's /health: every health_interval while it has requests of ours in flight or is out of rotation
    (a stuck scheduler is judged by a waiting /health; an ejected worker is readmitted by a good one), every
    idle_health_interval when it is idle and in (each probe is a generation in SGLang: an idle cluster would spend most
    of its CPU on them). A slow probe delays only its own worker's next one. Liveness (router/fleet/liveness.py) runs
    beside it; `upstream` is the data plane's client, whose exchanges with a hung worker are ended."""
    running: dict[str, asyncio.Task] = {}
    sent: dict[str, float] = {}
    watch = LivenessWatch(config, pool, client, upstream)
    liveness = asyncio.create_task(watch.run())
    try:
        while True:
            now = time.monotonic()
            for worker in list(pool.workers.values()):
                task = running.get(worker.worker_id)
                due = sent.get(worker.worker_id, -1e9) + (config.idle_health_interval if idle(worker) else 0.0) <= now
                if (task is None or task.done()) and due:
                    sent[worker.worker_id] = now
                    running[worker.worker_id] = asyncio.create_task(
                        probe(worker, client, config, watch.state(worker), traced))
            for gone in [wid for wid in running if wid not in pool.workers]:
                running.pop(gone).cancel()
                sent.pop(gone, None)
            await asyncio.sleep(config.health_interval)
    finally:
        liveness.cancel()
        for task in running.values():
            task.cancel()
