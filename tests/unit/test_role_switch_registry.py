"""A role flip as the bootstrap service keeps it (bootstrap/switch.py): each refusal with its stable code before
anything changes, the drain it starts, the order a launcher reads in its heartbeat's answer, and the ends (done by
re-registering under the new role, failed with the launcher's reason or the registry's deadline); and
`python -m bootstrap switch`, which follows it to one line and an exit status."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from bootstrap import switch as flips
from bootstrap.__main__ import main as bootstrap_main
from bootstrap.app import create_app
from bootstrap.config import BootstrapConfig
from tests.fakes import ServerThread
from tests.helpers import until
from tests.unit.test_bootstrap_service import registration

AUTH = {"Authorization": "Bearer s3cret"}


def flippable(worker_id: str, role: str, **extra) -> dict:
    return registration(worker_id, role, switch_enabled=True, **extra)


def cluster(c: TestClient, *rows: dict) -> None:
    for row in rows:
        assert c.put(f"/v1/workers/{row['worker_id']}", json=row, headers=AUTH).status_code == 200


def row_of(c: TestClient, worker_id: str) -> dict:
    return next(w for w in c.get("/v1/workers").json()["workers"] if w["registration"]["worker_id"] == worker_id)


def refusal(c: TestClient, worker_id: str, to: str) -> tuple[int, dict]:
    response = c.post(f"/v1/workers/{worker_id}/switch", json={"to": to}, headers=AUTH)
    return response.status_code, response.json().get("error", {})


def test_each_refusal_has_its_code_and_changes_nothing():
    with TestClient(create_app(BootstrapConfig(token="s3cret"))) as c:
        cluster(c, flippable("p1", "prefill"), flippable("d1", "decode"),
                registration("d2", "decode"), flippable("d3", "decode", identity={
                    "model_path": "m", "served_model_name": "m", "page_size": 1, "kv_cache_dtype": "auto",
                    "transfer_backend": "nixl"}))
        version = c.get("/v1/workers").json()["version"]
        assert c.post("/v1/workers/p1/switch", json={"to": "decode"}).status_code == 401  # a write: the token
        assert c.post("/v1/workers/nobody/switch", json={"to": "decode"}, headers=AUTH).status_code == 404
        bad = c.post("/v1/workers/p1/switch", json={"to": "router"}, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "to"
        for worker_id, to, code in (("p1", "prefill", "same_role"), ("p1", "decode", "last_of_role"),
                                    ("d2", "prefill", "not_switch_enabled"), ("d3", "prefill", "backend_cannot")):
            status, error = refusal(c, worker_id, to)
            assert (status, error["refusal"], error["code"], error["type"]) == (409, code, 409,
                                                                                "invalid_request_error"), error
            assert error["message"]
        assert c.get("/v1/workers").json()["version"] == version  # nothing moved
        assert all(w["switch"] is None and not w["draining"] for w in c.get("/v1/workers").json()["workers"])


def test_an_operator_drained_or_unhealthy_twin_does_not_count_for_the_last_of_a_role():
    with TestClient(create_app(BootstrapConfig(token="s3cret"))) as c:
        cluster(c, flippable("p1", "prefill"), flippable("p2", "prefill"), flippable("d1", "decode"))
        c.post("/v1/workers/p2/drain", headers=AUTH)
        assert refusal(c, "p1", "decode")[1]["refusal"] == "last_of_role"
        c.delete("/v1/workers/p2/drain", headers=AUTH)
        c.post("/v1/workers/p2/heartbeat", json={"healthy": False, "detail": "x"}, headers=AUTH)
        assert refusal(c, "p1", "decode")[1]["refusal"] == "last_of_role"


def test_a_flip_drains_reaches_the_launcher_and_ends_done_when_it_registers_in_its_new_role():
    with TestClient(create_app(BootstrapConfig(token="s3cret"))) as c:
        cluster(c, flippable("p1", "prefill"), flippable("p2", "prefill"), flippable("d1", "decode"))
        accepted = c.post("/v1/workers/p1/switch", json={"to": "decode"}, headers=AUTH)
        assert (accepted.status_code, accepted.json()) == (202, {"worker_id": "p1", "from": "prefill", "to": "decode",
                                                                 "state": "draining"})
        row = row_of(c, "p1")
        assert row["draining"] is True and row["switch"]["state"] == "draining" and row["switch"]["to"] == "decode"
        # One flip at a time, this worker or another.
        assert refusal(c, "p1", "decode")[1]["refusal"] == "switch_running"
        assert refusal(c, "p2", "decode")[1]["refusal"] == "switch_running"
        beat = c.post("/v1/workers/p1/heartbeat", json={"healthy": True}, headers=AUTH).json()
        assert beat["switch"]["to"] == "decode" and beat["switch"]["state"] == "draining"
        assert "switch" not in c.post("/v1/workers/p2/heartbeat", json={"healthy": True}, headers=AUTH).json()
        assert c.post("/v1/workers/p1/switch/progress", json={"state": "switching"}, headers=AUTH).status_code == 200
        assert row_of(c, "p1")["switch"]["switching_at"] is not None
        cluster(c, flippable("p1", "decode", instance_id="second"))
        row = row_of(c, "p1")
        assert row["registration"]["role"] == "decode" and row["draining"] is False
        assert row["switch"]["state"] == "done" and row["switch"]["ended"] >= row["switch"]["switching_at"]
        assert "switch" not in c.post("/v1/workers/p1/heartbeat", json={"healthy": True}, headers=AUTH).json()
        # Ended: nothing more to report, and the next flip may start (back to prefill: p2 is still a prefill).
        assert c.post("/v1/workers/p1/switch/progress", json={"state": "failed"}, headers=AUTH).status_code == 404
        assert c.post("/v1/workers/p1/switch", json={"to": "prefill"}, headers=AUTH).status_code == 202


def test_a_failed_flip_ends_the_drain_with_the_launchers_reason():
    with TestClient(create_app(BootstrapConfig(token="s3cret"))) as c:
        cluster(c, flippable("p1", "prefill"), flippable("p2", "prefill"), flippable("p3", "prefill"),
                flippable("d1", "decode"))
        c.post("/v1/workers/p1/drain", headers=AUTH)  # an operator's drain outlives the flip
        c.post("/v1/workers/p2/switch", json={"to": "decode"}, headers=AUTH)
        reason = "SGLang stayed busy for 60s"
        c.post("/v1/workers/p2/switch/progress", json={"state": "failed", "reason": reason}, headers=AUTH)
        row = row_of(c, "p2")
        assert (row["switch"]["state"], row["switch"]["reason"], row["draining"]) == ("failed", reason, False)
        assert row["registration"]["role"] == "prefill" and row_of(c, "p1")["draining"] is True


def test_a_flip_nobody_carries_out_is_given_up(monkeypatch):
    monkeypatch.setattr(flips, "SWITCH_DEADLINE", 0.2)
    with TestClient(create_app(BootstrapConfig(token="s3cret", ttl_seconds=600))) as c:
        cluster(c, flippable("p1", "prefill"), flippable("p2", "prefill"), flippable("d1", "decode"))
        c.post("/v1/workers/p1/switch", json={"to": "decode"}, headers=AUTH)
        assert until(lambda: row_of(c, "p1")["switch"]["state"] == "failed", timeout=5)
        assert "did not end the flip" in row_of(c, "p1")["switch"]["reason"]
        assert row_of(c, "p1")["draining"] is False


def _launcher(url: str, outcome: str) -> threading.Thread:
    """A launcher's part, by hand: it sees the order, reports switching, then registers anew or gives up."""
    import httpx

    def run() -> None:
        assert until(lambda: "switch" in httpx.post(f"{url}/v1/workers/p1/heartbeat", json={}).json(), timeout=10)
        httpx.post(f"{url}/v1/workers/p1/switch/progress", json={"state": "switching"})
        time.sleep(0.05)
        if outcome == "done":
            httpx.put(f"{url}/v1/workers/p1", json=flippable("p1", "decode", instance_id="2"))
        else:
            httpx.post(f"{url}/v1/workers/p1/switch/progress", json={"state": "failed", "reason": "it broke; "
                       "the launcher restarted SGLang in its old role"})

    return threading.Thread(target=run, daemon=True)


@pytest.mark.parametrize("outcome", ["done", "failed"])
def test_the_cli_follows_the_flip_to_one_line_and_its_exit_status(outcome, capsys):
    import httpx

    with ServerThread(create_app(BootstrapConfig(ttl_seconds=600))) as service:
        for row in (flippable("p1", "prefill"), flippable("p2", "prefill"), flippable("d1", "decode")):
            httpx.put(f"{service.url}/v1/workers/{row['worker_id']}", json=row)
        launcher = _launcher(service.url, outcome)
        launcher.start()
        code = bootstrap_main(["switch", "p1", "--to", "decode", "--url", service.url, "--wait", "20"])
        launcher.join()
        out, err = capsys.readouterr()
        if outcome == "done":
            assert code == 0 and out.startswith("p1: prefill -> decode done: drained in ") and "switched in" in out
        else:
            assert code == 1 and "failed: it broke; the launcher restarted SGLang in its old role" in err
        # A refusal: its code and reason, exit 1.
        assert bootstrap_main(["switch", "p2", "--to", "prefill", "--url", service.url, "--wait", "5"]) == 1
        assert "p2: refused (same_role): worker p2 is a prefill already" in capsys.readouterr().err
