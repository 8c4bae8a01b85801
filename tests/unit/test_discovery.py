"""Discovery (router/fleet/discovery.py): the router's pool follows the bootstrap service's registry."""

from __future__ import annotations

import httpx

from tests.fakes import FakeWorker, until
from tests.unit.test_admission import discovered, register, workers


def test_a_worker_gone_while_the_registry_was_young_leaves_the_pool_once_it_is_not():
    """A registry younger than its TTL may not have heard from every live worker yet, so the router drops nobody
    meanwhile. A worker deregistered in that window used to stay in the pool for good: the registry's version had
    not moved since, and the router only re-read a listing whose version moved."""
    with discovered({"p": FakeWorker(), "d": FakeWorker()}, {"p": "prefill", "d": "decode"}, ttl=10.0) as (
            service, _, router):
        assert set(workers(router)) == {"p", "d"}
        assert httpx.delete(f"{service}/v1/workers/d").status_code == 200
        assert httpx.get(f"{service}/v1/workers").json()["uptime_seconds"] < 10.0  # still young
        assert until(lambda: set(workers(router)) == {"p"}, timeout=40)  # (register() heartbeats p)
        answer = httpx.post(f"{router}/generate", json={"text": "x"})
        assert answer.status_code == 503, answer.text


def test_a_listing_from_a_newer_bootstrap_service_is_followed_for_what_this_router_knows(caplog):
    """Bootstrap service first in a rolling upgrade: its listing carries fields this router does not know. The
    router used to refuse the whole listing ("unreachable") and serve only its last known workers."""
    import asyncio

    from fastapi import FastAPI

    from pdcluster.common.protocol import WorkerListing
    from router.config import RouterConfig
    from router.fleet.discovery import follow_registry
    from router.fleet.workers import WorkerPool
    from tests.fakes import ServerThread
    from tests.unit.test_bootstrap_service import registration

    row = {"registration": {**registration("d1"), "forward_tokens_v9": 1}, "healthy": True, "registered_at": 0.0,
           "last_heartbeat": 0.0, "load_v9": {"x": 1}}
    listing = {"version": 7, "ttl_seconds": 5.0, "uptime_seconds": 60.0, "workers": [row], "shards_v9": []}
    app = FastAPI()

    @app.get("/v1/workers")
    async def workers_listed() -> dict:
        await asyncio.sleep(0.05)
        return listing

    async def follow(url: str) -> WorkerPool:
        pool, seen = WorkerPool(admission_check=False), asyncio.Event()
        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(follow_registry(RouterConfig(bootstrap_url=url), pool, client, seen))
            await asyncio.wait_for(seen.wait(), 10)
            task.cancel()
        return pool

    with ServerThread(app) as registry:
        pool = asyncio.run(follow(registry.url))
    assert list(pool.workers) == ["d1"]
    assert "shards_v9" in caplog.text and "workers[].load_v9" in caplog.text
    assert "workers[].registration.forward_tokens_v9" in caplog.text
    try:
        WorkerListing.model_validate(listing)
    except ValueError:
        pass
    else:
        raise AssertionError("the protocol's models refuse unknown fields: only from_newer drops them")


def test_a_worker_that_flips_its_role_at_the_same_address_is_a_new_instance_of_the_other_role():
    """A live role flip (pdcluster/worker/role_flip.py): the same id and URL registered again in the other role, as a
    new instance. The router drops the prefill, admits the decode through its canary, and its policies forget what
    they kept of the prefill; requests go on through the new pairs."""
    fakes = {"p1": FakeWorker(), "p2": FakeWorker(), "d1": FakeWorker()}
    with discovered(fakes, {"p1": "prefill", "p2": "prefill", "d1": "decode"}) as (service, urls, router):
        assert until(lambda: len(workers(router)) == 3 and all(
            w["admission"] == "admitted" for w in workers(router).values()))
        register(service, "p2", "decode", urls["p2"], instance="2")
        assert until(lambda: workers(router)["p2"]["role"] == "decode"
                     and workers(router)["p2"]["admission"] == "admitted")
        served = {httpx.post(f"{router}/generate", json={"text": "a"}, timeout=30).headers["x-pdcluster-decode"]
                  for _ in range(6)}
        assert served <= {"d1", "p2"} and httpx.get(f"{router}/ready").status_code == 200


def test_the_pool_tells_its_policies_when_a_worker_changes_role():
    from pdcluster.common.protocol import WorkerStatus
    from router.fleet.workers import WorkerPool
    from tests.unit.test_bootstrap_service import registration

    forgotten: list[str] = []
    pool = WorkerPool(admission_check=False, on_removed=[forgotten.append])

    def row(role: str, instance: str) -> WorkerStatus:
        return WorkerStatus.model_validate({"registration": registration("w", role) | {"instance_id": instance},
                                            "healthy": True, "registered_at": 0.0, "last_heartbeat": 0.0})

    pool.sync_discovered([row("prefill", "1")])
    pool.sync_discovered([row("prefill", "2")])  # a restart: same role, nothing of the policies' to forget
    assert forgotten == []
    pool.sync_discovered([row("decode", "3")])
    assert forgotten == ["w"] and pool.workers["w"].role.value == "decode"
