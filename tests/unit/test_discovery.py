"""Discovery (router/discovery.py): the router's pool follows the bootstrap service's registry."""

from __future__ import annotations

import httpx

from tests.fakes import FakeWorker, until
from tests.unit.test_admission import discovered, workers


def test_a_worker_gone_while_the_registry_was_young_leaves_the_pool_once_it_is_not():
    """A registry younger than its TTL may not have heard from every live worker yet, so the router drops nobody
    meanwhile. A worker deregistered in that window used to stay in the pool for good: the registry's version had
    not moved since, and the router only re-read a listing whose version moved."""
    with discovered({"p": FakeWorker(), "d": FakeWorker()}, {"p": "prefill", "d": "decode"}, ttl=3.0) as (
            service, _, router):
        assert set(workers(router)) == {"p", "d"}
        assert httpx.delete(f"{service}/v1/workers/d").status_code == 200
        assert httpx.get(f"{service}/v1/workers").json()["uptime_seconds"] < 3.0  # still young
        assert until(lambda: set(workers(router)) == {"p"}, timeout=20)  # (register() heartbeats p)
        answer = httpx.post(f"{router}/generate", json={"text": "x"})
        assert answer.status_code == 503, answer.text
