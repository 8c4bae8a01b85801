"""Keep the pool's health true: follow the bootstrap service's registry, and probe every worker's /health.

Discovery long-polls the registry (`wait_version`), so a new or dead worker shows up within a fraction of a second.
While the bootstrap service is down, the last known set stays in service.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from pdcluster.protocol import WorkerListing
from router.config import RouterConfig
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


async def probe(worker: Worker, client: httpx.AsyncClient, config: RouterConfig) -> None:
    try:
        response = await client.get(f"{worker.url}/health", timeout=config.health_timeout)
        ok = response.status_code == 200
    except httpx.HTTPError:
        ok = False
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


async def probe_forever(config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient) -> None:
    """Probe every worker each health_interval; a slow probe (SGLang's /health generates a token) delays only its
    own worker's next probe, never the others'."""
    running: dict[str, asyncio.Task] = {}
    try:
        while True:
            for worker in list(pool.workers.values()):
                task = running.get(worker.worker_id)
                if task is None or task.done():
                    running[worker.worker_id] = asyncio.create_task(probe(worker, client, config))
            for gone in [wid for wid in running if wid not in pool.workers]:
                running.pop(gone).cancel()
            await asyncio.sleep(config.health_interval)
    finally:
        for task in running.values():
            task.cancel()
