"""Discovery (router/discovery.py): the router's pool follows the bootstrap service's registry."""

from __future__ import annotations

import httpx

from bootstrap.app import create_app as create_bootstrap
from bootstrap.config import BootstrapConfig
from router.app import create_app
from router.config import RouterConfig
from tests.fakes import FakeWorker, ServerThread, until
from tests.unit.test_admission import register, workers


def test_a_worker_gone_while_the_registry_was_young_leaves_the_pool_once_it_is_not():
    """A registry younger than its TTL may not have heard from every live worker yet, so the router drops nobody
    meanwhile. A worker deregistered in that window used to stay in the pool for good: the registry's version had
    not moved since, and the router only re-read a listing whose version moved."""
    prefill, decode = FakeWorker(), FakeWorker()
    with ServerThread(create_bootstrap(BootstrapConfig(ttl_seconds=3.0))) as service, \
            ServerThread(prefill.app()) as p, ServerThread(decode.app()) as d:
        register(service.url, "p", "prefill", p.url)
        register(service.url, "d", "decode", d.url)
        with ServerThread(create_app(RouterConfig(bootstrap_url=service.url, expose_worker_ids=True))) as router:
            assert set(workers(router.url)) == {"p", "d"}
            assert httpx.delete(f"{service.url}/v1/workers/d").status_code == 200
            assert httpx.get(f"{service.url}/v1/workers").json()["uptime_seconds"] < 3.0  # still young
            assert until(lambda: set(workers(router.url)) == {"p"}, timeout=20)  # (register() heartbeats p)
            answer = httpx.post(f"{router.url}/generate", json={"text": "x"})
            assert answer.status_code == 503, answer.text
