"""Health probes: every worker's /health each health_interval, which ejects a worker after unhealthy_threshold
failures in a row and readmits it on one success; liveness (router/liveness.py) runs beside them.

SGLang's /health runs a real one-token generation: >= 1 s, longer under load, and it gives up only after 20 s, so
it cannot tell "slow" from "hung" quickly: that is liveness's job.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from router.config import RouterConfig
from router.liveness import Liveness, LivenessWatch
from router.upstream import UpstreamClient
from router.workers import Worker, WorkerPool

log = logging.getLogger("pdcluster.router")


async def probe(worker: Worker, client: httpx.AsyncClient, config: RouterConfig,
                liveness: Liveness | None = None) -> None:
    if liveness is not None:
        liveness.health_sent(time.monotonic())
    try:
        response = await client.get(f"{worker.url}/health", timeout=config.health_timeout)
        ok = response.status_code == 200
    except httpx.TimeoutException:
        # Its scheduler is busy or stuck: no verdict here. Liveness judges that, with the time the work in flight on
        # the worker may take (one long prompt can keep SGLang's /health waiting for longer than health_timeout).
        return
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
                        upstream: UpstreamClient | None = None) -> None:
    """Probe every worker each health_interval; a slow probe (SGLang's /health generates a token) delays only its
    own worker's next probe, never the others'. Liveness (router/liveness.py) runs beside it; `upstream`
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
