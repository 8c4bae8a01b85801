"""Drain on demand: an operator takes a worker out of the routers' pools without stopping it (the registry keeps the
mark, also when the worker registers again), the router sends it nothing new while what it has finishes, and puts it
back on resume."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from bootstrap.app import create_app as create_bootstrap
from bootstrap.config import BootstrapConfig
from bootstrap.status import format_table
from pdcluster.common.protocol import WorkerListing
from router.app import create_app
from router.config import RouterConfig
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.helpers import until
from tests.unit.test_bootstrap_service import registration


def test_the_registry_marks_a_drained_worker_until_resumed_also_across_re_registration():
    with TestClient(create_bootstrap(BootstrapConfig(token="s3cret"))) as c:
        auth = {"Authorization": "Bearer s3cret"}
        assert c.put("/v1/workers/d1", json=registration("d1"), headers=auth).status_code == 200
        assert c.post("/v1/workers/d1/drain").status_code == 401  # a write: it needs the token
        assert c.post("/v1/workers/nobody/drain", headers=auth).status_code == 404
        assert c.post("/v1/workers/d1/drain", headers=auth).json() == {"worker_id": "d1", "draining": True}
        assert c.get("/v1/workers").json()["workers"][0]["draining"] is True
        assert c.put("/v1/workers/d1", json=registration("d1"), headers=auth).status_code == 200  # it restarted
        listing = c.get("/v1/workers").json()
        assert listing["workers"][0]["draining"] is True
        assert "draining" in format_table(WorkerListing.model_validate(listing))
        assert c.delete("/v1/workers/d1/drain", headers=auth).json()["draining"] is False
        assert c.get("/v1/workers").json()["workers"][0]["draining"] is False


def test_a_drained_decode_finishes_its_stream_gets_nothing_new_and_comes_back_on_resume():
    decodes = [FakeWorker(Behaviour(chunks=30, chunk_delay=0.05)), FakeWorker(Behaviour(chunks=30, chunk_delay=0.05))]
    prefill = FakeWorker()
    # Registered once, with no heartbeats: a TTL longer than the test (the default 5 s ran out on a busy machine, and
    # the prefill left the pool mid-test).
    with ServerThread(create_bootstrap(BootstrapConfig(ttl_seconds=600))) as service, ServerThread(prefill.app()) as p,\
            ServerThread(decodes[0].app()) as d0, ServerThread(decodes[1].app()) as d1:
        for worker_id, role, url in (("p", "prefill", p.url), ("d0", "decode", d0.url), ("d1", "decode", d1.url)):
            assert httpx.put(f"{service.url}/v1/workers/{worker_id}",
                             json=registration(worker_id, role) | {"url": url}).status_code == 200
        config = RouterConfig(bootstrap_url=service.url, health_interval=0.2, expose_worker_ids=True)
        with ServerThread(create_app(config)) as router:
            assert until(lambda: httpx.get(f"{router.url}/ready").status_code == 200)
            events: list[str] = []

            def stream() -> None:
                with httpx.stream("POST", f"{router.url}/generate", json={"text": "a", "stream": True},
                                  timeout=30) as r:
                    assert r.headers["x-pdcluster-decode"] == "d0"
                    events.extend(line for line in r.iter_lines() if line.startswith("data:"))

            streamer = threading.Thread(target=stream)
            streamer.start()
            assert until(lambda: len(decodes[0].received) == 1)
            assert httpx.post(f"{service.url}/v1/workers/d0/drain").status_code == 200
            assert until(lambda: _worker(router.url, "d0")["draining"])
            assert _worker(router.url, "d0")["unusable"].startswith("draining")
            served = {_decode_of(httpx.post(f"{router.url}/generate", json={"text": "b"}, timeout=10))
                      for _ in range(6)}
            streamer.join(30)
            assert served == {"d1"}  # nothing new went to the drained decode...
            assert events[-1] == "data: [DONE]"  # ... and the stream it had ran to its end
            assert httpx.delete(f"{service.url}/v1/workers/d0/drain").status_code == 200
            assert until(lambda: not _worker(router.url, "d0")["draining"])
            served = {_decode_of(httpx.post(f"{router.url}/generate", json={"text": "c"}, timeout=10))
                      for _ in range(4)}
            assert served == {"d0", "d1"}


def _decode_of(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.headers["x-pdcluster-decode"]


def _worker(url: str, worker_id: str) -> dict:
    return next(w for w in httpx.get(f"{url}/ready").json()["workers"] if w["worker_id"] == worker_id)


def test_a_router_started_under_load_serves_its_pool_from_its_first_request():
    """A router killed and started again must not answer 503 while it learns its workers: it starts listening only
    once it has the registry's listing (Dynamo #4904: a frontend that never finds its workers again). The registry
    here takes a second to answer, as a busy one may."""
    prefill, decode = FakeWorker(), FakeWorker()
    with ServerThread(prefill.app()) as p, ServerThread(decode.app()) as d:
        now = time.time()
        rows = [{"registration": registration(worker_id, role) | {"url": url}, "healthy": True,
                 "registered_at": now, "last_heartbeat": now} for worker_id, role, url in
                (("p", "prefill", p.url), ("d", "decode", d.url))]
        slow = FastAPI()

        @slow.get("/v1/workers")
        async def workers() -> dict:
            await asyncio.sleep(1.0)
            return {"version": 1, "ttl_seconds": 5, "uptime_seconds": 100, "workers": rows}

        with ServerThread(slow) as service:
            for _ in range(2):  # started, stopped and started again
                with ServerThread(create_app(RouterConfig(bootstrap_url=service.url))) as router:
                    answer = httpx.post(f"{router.url}/generate", json={"text": "first"}, timeout=10)
                    assert answer.status_code == 200, answer.text


def test_an_idle_worker_is_probed_seldom_and_a_busy_one_every_health_interval():
    """Each SGLang /health is a one-token generation: an idle cluster probed every second spent most of its idle CPU
    on them. Busy (a request of ours in flight), a worker's /health is what tells a stuck scheduler."""
    probes: list[float] = []

    class Counting(FakeWorker):
        def app(self):
            app = super().app()

            @app.middleware("http")
            async def count(request, call_next):
                if request.url.path == "/health":
                    probes.append(time.monotonic())
                return await call_next(request)
            return app

    decode = Counting(Behaviour(chunks=40, chunk_delay=0.05))
    with ServerThread(FakeWorker().app()) as p, ServerThread(decode.app()) as d:
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                              decode=[{"url": d.url}], health_interval=0.2, idle_health_interval=3.0)
        with ServerThread(create_app(config)) as router:
            time.sleep(2.5)
            idle_probes = len(probes)
            started = time.monotonic()
            httpx.post(f"{router.url}/generate", json={"text": "s", "stream": True}, timeout=30)  # ~2 s of stream
            busy = [t for t in probes if t >= started]
    assert idle_probes <= 2, idle_probes  # the first one, and at most one more in 2.5 s
    assert len(busy) >= 5, len(busy)
