"""The bootstrap service: registration, heartbeats with a TTL, compatibility, auth, long-poll discovery."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from bootstrap.app import create_app
from bootstrap.config import BootstrapConfig
from tests.helpers import until


def registration(worker_id: str, role: str = "decode", page_size: int = 1, **extra) -> dict:
    body = {
        "worker_id": worker_id, "role": role, "url": f"http://127.0.0.1:{30000 + len(worker_id)}",
        "identity": {"model_path": "m", "served_model_name": "m", "page_size": page_size, "kv_cache_dtype": "auto",
                     "transfer_backend": "mooncake"},
    }
    if role == "prefill":
        body |= {"kv_bootstrap_host": "127.0.0.1", "kv_bootstrap_port": 8999}
    return body | extra


def client(**config) -> TestClient:
    return TestClient(create_app(BootstrapConfig(**config)))


def test_register_list_heartbeat_deregister():
    with client() as c:
        assert c.put("/v1/workers/d1", json=registration("d1")).status_code == 200
        listing = c.get("/v1/workers").json()
        assert [w["registration"]["worker_id"] for w in listing["workers"]] == ["d1"]
        assert c.post("/v1/workers/d1/heartbeat", json={"healthy": False, "detail": "SGLang /health 503"}).json()
        assert c.get("/v1/workers").json()["workers"][0]["healthy"] is False
        assert c.delete("/v1/workers/d1").status_code == 200
        assert c.get("/v1/workers").json()["workers"] == []
        assert c.post("/v1/workers/d1/heartbeat", json={}).status_code == 404




def test_silent_worker_leaves_the_listing_after_the_ttl():
    with client(ttl_seconds=0.5) as c:
        c.put("/v1/workers/d1", json=registration("d1"))
        registered = time.monotonic()
        assert len(c.get("/v1/workers").json()["workers"]) == 1
        # Gone after the TTL; how soon after depends on how busy the machine is, so only "not before" is exact.
        assert until(lambda: c.get("/v1/workers").json()["workers"] == [], timeout=10)
        assert time.monotonic() - registered >= 0.5


def test_a_stall_of_the_service_itself_drops_no_worker():
    """Seen in the e2e suite: every process of a busy 2-core machine stalled ~6 s; on waking, the service expired a
    worker whose heartbeats of that time were still unread in its socket, and the cluster had no decode for a while.
    Its own stall now counts against nobody; a worker that stays silent afterwards still goes after the TTL."""
    with client(ttl_seconds=1.0) as c:
        c.put("/v1/workers/d1", json=registration("d1"))
        c.portal.call(time.sleep, 2.5)  # the service's event loop does not run for 2.5 s (TTL 1 s)
        assert [w["registration"]["worker_id"] for w in c.get("/v1/workers").json()["workers"]] == ["d1"]
        assert until(lambda: c.get("/v1/workers").json()["workers"] == [], timeout=10)


def test_bad_payloads_get_400_naming_the_field():
    with client() as c:
        bad_role = c.put("/v1/workers/x", json=registration("x", role="encoder"))
        assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "role"
        no_port = registration("p", role="prefill")
        del no_port["kv_bootstrap_port"]
        assert "kv_bootstrap_port" in c.put("/v1/workers/p", json=no_port).json()["error"]["message"]
        assert c.put("/v1/workers/y", json=registration("x")).status_code == 400  # id mismatch
        assert c.put("/v1/workers/x", content=b"x" * 100_000).status_code == 413


def test_writes_need_the_token_when_one_is_configured():
    with client(token="t0k") as c:
        assert c.put("/v1/workers/d1", json=registration("d1")).status_code == 401
        wrong = c.put("/v1/workers/d1", json=registration("d1"), headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = c.put("/v1/workers/d1", json=registration("d1"), headers={"authorization": "Bearer t0k"})
        assert ok.status_code == 200
        assert c.get("/v1/workers").status_code == 200  # reads stay open


def test_incompatible_workers_are_reported_with_the_reason():
    with client() as c:
        c.put("/v1/workers/p1", json=registration("p1", role="prefill", page_size=1))
        answer = c.put("/v1/workers/d1", json=registration("d1", page_size=16)).json()
        assert "page_size 16 vs 1" in answer["incompatible"]
        rows = {w["registration"]["worker_id"]: w for w in c.get("/v1/workers").json()["workers"]}
        assert "page_size" in rows["p1"]["incompatible"] and "page_size" in rows["d1"]["incompatible"]


def test_long_poll_answers_on_the_next_change():
    """The poll is parked in the registry before the change is made, from another thread, and must return on that
    change, not at its own timeout (30 s): judged relative to the change, so a busy machine cannot fail it."""
    with client() as c:
        version = c.get("/v1/workers").json()["version"]
        registry = c.app.state.registry
        parked = threading.Event()
        wait_for_change = registry.wait_for_change

        async def parking(*args):
            parked.set()
            await wait_for_change(*args)

        registry.wait_for_change = parking
        answer: dict = {}

        def poll() -> None:
            answer["listing"] = c.get("/v1/workers", params={"wait_version": version, "timeout": 30}).json()
            answer["at"] = time.monotonic()

        poller = threading.Thread(target=poll)
        started = time.monotonic()
        poller.start()
        assert parked.wait(timeout=20)
        assert c.put("/v1/workers/d1", json=registration("d1")).status_code == 200
        changed = time.monotonic()
        poller.join(timeout=40)
        assert not poller.is_alive()
        assert answer["at"] - started < 25  # it did not wait out its 30 s: the change woke it
        assert answer["at"] - changed < 10
        listing = answer["listing"]
        assert listing["version"] > version and len(listing["workers"]) == 1


def test_an_older_launchers_former_field_names_are_read_and_the_listing_carries_both():
    """kv_bootstrap_host and kv_bootstrap_port were bootstrap_host and bootstrap_port (WorkerRegistration.RENAMED): a
    launcher from before the rename registers under the former names, and the listing has both, so that a router from
    before it reads the listing too. Two names that disagree are a sender's bug: refused."""
    older = registration("p1", role="prefill")
    older |= {"bootstrap_host": older.pop("kv_bootstrap_host"), "bootstrap_port": older.pop("kv_bootstrap_port")}
    with client() as c:
        assert c.put("/v1/workers/p1", json=older).status_code == 200
        listed = c.get("/v1/workers").json()["workers"][0]["registration"]
        assert (listed["kv_bootstrap_host"], listed["kv_bootstrap_port"]) == ("127.0.0.1", 8999)
        assert (listed["bootstrap_host"], listed["bootstrap_port"]) == ("127.0.0.1", 8999)
        both = c.put("/v1/workers/p2", json=registration("p2", role="prefill", bootstrap_port=8999))
        assert both.status_code == 200
        disagreeing = c.put("/v1/workers/p3", json=registration("p3", role="prefill", bootstrap_port=9000))
        assert disagreeing.status_code == 400
        assert "bootstrap_port (the former name of kv_bootstrap_port) and kv_bootstrap_port differ" in \
            disagreeing.json()["error"]["message"]


def test_a_newer_launchers_registration_is_taken_for_what_this_service_knows(caplog):
    """A rolling upgrade may start a newer launcher before the bootstrap service: the fields this version does not
    know are dropped and logged (not a 400 that keeps the worker out of every pool); what it knows is checked as
    strictly as ever."""
    newer = registration("d1", forward_tokens_v9=4096, identity={**registration("d1")["identity"], "new_key": 1})
    with client() as c:
        assert c.put("/v1/workers/d1", json=newer).status_code == 200
        listed = c.get("/v1/workers").json()["workers"][0]["registration"]
        assert "forward_tokens_v9" not in listed and "new_key" not in listed["identity"]
        assert c.post("/v1/workers/d1/heartbeat", json={"healthy": True, "load_v9": 3}).status_code == 200
        wrong = c.put("/v1/workers/d1", json={**newer, "context_length": "long"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "context_length"
    assert "forward_tokens_v9" in caplog.text and "identity.new_key" in caplog.text and "load_v9" in caplog.text
