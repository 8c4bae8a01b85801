"""Discovery: the workers the router config lists (`static_workers`), and the bootstrap service's registry of workers
followed into the pool.

It long-polls the registry (`wait_version`), so a new or dead worker shows up within a fraction of a second. While
the bootstrap service is down, the last known set stays in service. A listing from a newer bootstrap service (a
rolling upgrade) is read for what this router knows; the fields it does not know are named once in the log.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlparse

import httpx

from pdcluster.common.protocol import Role, WorkerCapabilities, WorkerListing, from_newer
from router.config import RouterConfig, StaticWorker
from router.fleet.workers import Worker, WorkerPool

log = logging.getLogger("pdcluster.router")


# Seconds a starting router waits for the registry's listing and its workers' admission before it serves anyway.
FIRST_LISTING_WAIT = 30.0


async def follow_registry(config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient,
                          first_listing: asyncio.Event | None = None) -> None:
    """Keep the pool equal to the registry. `first_listing` is set once the pool holds the registry's workers: a
    router started (or restarted) under load serves its whole pool from its first request, not a 503."""
    version: int | None = None
    warming_up = False
    unknown_fields: list[str] = []
    headers = {"Authorization": f"Bearer {config.bootstrap_token}"} if config.bootstrap_token else {}
    while True:
        params: dict = {"timeout": 10.0}
        if version is not None and not warming_up:
            params["wait_version"] = version
        try:
            response = await client.get(f"{config.bootstrap_url}/v1/workers", params=params, headers=headers,
                                        timeout=httpx.Timeout(5.0, read=15.0))
            response.raise_for_status()
            listing, dropped = from_newer(WorkerListing, response.json())
        except (httpx.HTTPError, ValueError) as exc:
            if version is not None:
                log.warning("bootstrap service unreachable or its listing unreadable; serving the last known workers",
                            extra={"error": str(exc)[:300], "workers": len(pool.workers)})
            version = None
            await asyncio.sleep(1.0)
            continue
        if dropped and dropped != unknown_fields:
            unknown_fields = dropped
            log.warning("the registry lists fields this router does not know (a newer pdcluster): %s; ignored, "
                        "upgrade the routers", ", ".join(dropped))
        was_warming_up, warming_up = warming_up, listing.warming_up
        if listing.version != version or warming_up or was_warming_up:
            # A young registry has not heard from every live worker yet: add, but don't drop, until it has. The first
            # listing after that drops what went missing meanwhile (its version may not move again for a long time).
            pool.sync_discovered(listing.workers, remove_missing=not warming_up)
        version = listing.version
        if first_listing is not None:
            first_listing.set()
        if warming_up:
            await asyncio.sleep(0.2)


def static_worker(spec: StaticWorker, role: Role, index: int) -> Worker:
    """A worker the router config lists (`prefill:`, `decode:`), as the pool keeps it."""
    url = str(spec.url).rstrip("/")
    host = spec.kv_bootstrap_host or urlparse(url).hostname
    capabilities = WorkerCapabilities(tool_call_parser=spec.tool_call_parser, reasoning_parser=spec.reasoning_parser,
                                      deterministic_inference=spec.deterministic_inference,
                                      priority_scheduling=spec.priority_scheduling)
    return Worker(f"static-{role.value}-{index}", role, url, host if role is Role.PREFILL else None,
                  spec.kv_bootstrap_port, vocab_size=spec.vocab_size, context_length=spec.context_length,
                  forward_tokens=spec.forward_tokens, static=True, capabilities=capabilities)


def static_workers(config: RouterConfig) -> list[Worker]:
    """The workers the router config lists, each role's numbered from 0."""
    return [static_worker(spec, role, index)
            for role, specs in ((Role.PREFILL, config.prefill), (Role.DECODE, config.decode))
            for index, spec in enumerate(specs)]
