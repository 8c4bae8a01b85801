"""A role flip as the worker's launcher carries it out (pdcluster/worker/role_flip.py), against a fake SGLang in
process and the real bootstrap service: it learns of the flip from its heartbeat's answer, waits while SGLang is not
idle, switches it, registers under the new role as a new instance (done); SGLang refusing or staying busy fails the
flip with its reason and leaves the worker as it was; a switch that fails half-way restarts SGLang in its old role
and says so. And how a switch-enabled worker is launched (pdcluster/worker/switching.py), and the supervisor's
restart."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import httpx
import psutil
import pytest
from fastapi import FastAPI

import decode.plan
import prefill.plan
from bootstrap.app import create_app as create_bootstrap
from bootstrap.config import BootstrapConfig
from pdcluster.common.config_file import ConfigError
from pdcluster.common.protocol import KVEventsEndpoint, Role, WorkerRegistration
from pdcluster.common.sglang_args import sglang_parser
from pdcluster.worker import role_flip, switching
from pdcluster.worker.options import SGLangOptions
from pdcluster.worker.plan import LaunchPlan
from pdcluster.worker.registrar import Registrar
from pdcluster.worker.settings import ClusterSettings
from tests.fakes import ServerThread
from tests.helpers import until
from tests.unit.test_bootstrap_service import registration
from tests.unit.test_worker_plan import argv_value, plan

NOT_IDLE = "instance is not idle; drain all requests before switching"  # SGLang 0.5.23's words


class FakeSGLang:
    """SGLang's HTTP side as a flip meets it: `busy` "not idle" answers first, then `outcome` (ok, refused, half)."""

    def __init__(self, busy: int = 0, outcome: str = "ok"):
        self.role, self.busy, self.outcome, self.healthy = "prefill", busy, outcome, True
        self.asked: list[dict] = []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {} if self.healthy else httpx.Response(503)

        @app.get("/server_info")
        async def server_info():
            # /server_info keeps the role SGLang started in after a flip (measured): the launcher must not read it
            return {"max_total_num_tokens": 4096, "num_reserved_decode_tokens": 128, "disaggregation_mode": "prefill"}

        @app.post("/pd_role_switch")
        async def switch(body: dict):
            self.asked.append(body)
            answer = {"old_role": self.role, "new_role": body["new_role"], "safe_to_restore": True}
            if self.busy > 0:
                self.busy -= 1
                return answer | {"success": False, "message": NOT_IDLE}
            if self.outcome == "refused":
                return answer | {"success": False, "message": "staging buffer is not supported with role switch"}
            if body["prepare_only"]:
                return answer | {"success": True, "message": "ready"}
            if self.outcome == "half":
                self.healthy = False
                return answer | {"success": False, "safe_to_restore": False,
                                 "message": "role switch failed; instance unhealthy, restart required: boom"}
            self.role = body["new_role"]
            return answer | {"success": True, "message": "ok"}

        return app


def launcher(service_url: str, sglang_url: str, restart: Callable[[], None], role: str = "prefill") -> Registrar:
    """Started as a prefill; registered as `role` (a decode: flipped before)."""
    reg = registration("p1", role, switch_enabled=True, url=sglang_url, instance_id="first")
    flip = switching.FlipPlan("127.0.0.1", 8999, KVEventsEndpoint(host="127.0.0.1", port=5557, replay_port=5558))
    plan = LaunchPlan(Role.PREFILL, ["sglang"], {}, {}, ClusterSettings(bootstrap_url=service_url,
                      heartbeat_interval=0.1, health_interval=0.2, ready_timeout=20),
                      WorkerRegistration.model_validate(reg | {"kv_events": flip.kv_events.model_dump()}), True, flip)
    registrar = Registrar(plan, probe_timeout=2.0, on_flip=lambda order: role_flip.RoleFlip(
        registrar, order, restart).start())  # as pdcluster/worker/cli.py wires it
    return registrar


def row_of(url: str, worker_id: str) -> dict:
    """Its listing row (its switch {} while it has none; {} while it is not registered)."""
    rows = httpx.get(f"{url}/v1/workers").json()["workers"]
    row = next((w for w in rows if w["registration"]["worker_id"] == worker_id), {"registration": {}})
    return row | {"switch": row.get("switch") or {}}


def flip(fake: FakeSGLang, on_restart=None, role: str = "prefill") -> tuple[dict, list[int], float]:
    """Flip p1 (a `role` beside another prefill and a decode) to the other role; its row once the flip ended."""
    restarts: list[int] = []
    with ServerThread(create_bootstrap(BootstrapConfig(ttl_seconds=600))) as service, \
            ServerThread(fake.app()) as sglang:
        for row in (registration("p2", "prefill", switch_enabled=True), registration("d1", "decode")):
            httpx.put(f"{service.url}/v1/workers/{row['worker_id']}", json=row)
        def restart() -> None:  # what Supervisor.restart would do, told to the test
            restarts.append(1)
            if on_restart is not None:
                on_restart()

        worker = launcher(service.url, sglang.url, restart, role)
        worker.start()
        try:
            assert until(lambda: row_of(service.url, "p1")["registration"].get("instance_id") == "first")
            asked = time.monotonic()
            to = "decode" if role == "prefill" else "prefill"
            assert httpx.post(f"{service.url}/v1/workers/p1/switch", json={"to": to}).status_code == 202
            assert until(lambda: row_of(service.url, "p1")["switch"].get("state") in ("done", "failed"),
                         timeout=30)
            took = time.monotonic() - asked
            if row_of(service.url, "p1")["switch"]["state"] == "done" or restarts:  # a new instance: registered anew
                assert until(lambda: row_of(service.url, "p1")["registration"]["instance_id"] != "first", timeout=10)
            return row_of(service.url, "p1"), restarts, took
        finally:
            worker.stop()


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(role_flip, "ROUTERS_FOLLOW", 0.05)
    monkeypatch.setattr(role_flip, "POLL", 0.02)


def test_the_launcher_waits_for_idle_switches_and_registers_a_new_decode_instance():
    fake = FakeSGLang(busy=3)
    row, restarts, _ = flip(fake)
    reg = row["registration"]
    assert row["switch"]["state"] == "done" and row["draining"] is False and restarts == []
    assert reg["role"] == "decode" and reg["switch_enabled"] is True
    assert (reg["kv_bootstrap_port"], reg["kv_events"], reg["reserved_decode_tokens"]) == (None, None, 128)
    assert row["switch"]["started"] <= row["switch"]["switching_at"] <= row["switch"]["ended"]
    # SGLang's checks first, changing nothing, until it is idle; then the switch, with no CUDA graphs to capture.
    assert fake.asked[0]["prepare_only"] is True and fake.asked[-1]["prepare_only"] is False
    assert all(body["new_role"] == "decode" and body["decode_cuda_graph_memory_gb"] == 0 for body in fake.asked)
    assert fake.role == "decode"


def test_sglang_refusing_fails_the_flip_with_its_reason_and_the_worker_serves_on_as_it_was():
    row, restarts, _ = flip(FakeSGLang(outcome="refused"))
    assert row["switch"]["state"] == "failed" and "staging buffer" in row["switch"]["reason"]
    assert row["registration"]["role"] == "prefill" and row["draining"] is False and restarts == []
    assert row["registration"]["instance_id"] == "first"  # untouched: the routers keep it as it was


def test_sglang_busy_past_the_bound_fails_the_flip(monkeypatch):
    monkeypatch.setattr(role_flip, "IDLE_TIMEOUT", 0.3)
    row, restarts, took = flip(FakeSGLang(busy=10_000))
    assert row["switch"]["state"] == "failed" and "not idle within 0s" in row["switch"]["reason"]
    assert row["registration"]["role"] == "prefill" and restarts == [] and took < 10


def test_a_switch_that_fails_half_way_restarts_sglang_in_its_old_role_and_says_so():
    fake = FakeSGLang(outcome="half")

    def restarted() -> None:  # what Supervisor.restart does: the same command, so the old role
        fake.role, fake.healthy, fake.outcome = "prefill", True, "ok"

    row, restarts, _ = flip(fake, restarted)
    assert restarts == [1] and row["switch"]["state"] == "failed"
    assert "failed half-way" in row["switch"]["reason"] and "restarted SGLang in its old role (prefill)" in \
        row["switch"]["reason"]
    assert row["registration"]["role"] == "prefill" and row["registration"]["kv_bootstrap_port"] == 8999
    assert row["draining"] is False


def test_a_half_way_failure_after_an_earlier_flip_restarts_it_in_the_role_it_was_started_in_and_says_so():
    fake = FakeSGLang(outcome="half")
    fake.role = "decode"  # started as a prefill, flipped to decode before; now flipping back fails half-way
    row, restarts, _ = flip(fake, lambda: setattr(fake, "healthy", True), role="decode")
    assert restarts == [1] and row["switch"]["state"] == "failed" and row["registration"]["role"] == "prefill"
    assert "restarted SGLang in the role it was started in (prefill), not its old one (decode)" in \
        row["switch"]["reason"]


def test_workers_start_switch_enabled_with_their_own_kv_bootstrap_port_and_kv_events(tmp_path, model_dir):
    d = plan(tmp_path, model_dir, role=Role.DECODE)
    assert "--enable-pd-role-switch" in d.command and d.registration.switch_enabled
    # The decode runs a KV bootstrap server and KV events it registers only as a prefill; both CPU profiles.
    assert int(argv_value(d.command, "--disaggregation-bootstrap-port")) != 8998 and "--kv-events-config" in d.command
    assert d.registration.kv_bootstrap_port is None and d.registration.kv_events is None
    assert d.flip is not None and d.flip.kv_events is not None
    assert "--disable-overlap-schedule" in d.command and d.env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] == "1"
    p = plan(tmp_path, model_dir)
    assert argv_value(p.command, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    # A prefill's radix cache, once it is a decode, is counted as room for new requests; a decode keeps SGLang's own.
    assert "--disaggregation-decode-enable-radix-cache" in p.command
    assert "--disaggregation-decode-enable-radix-cache" not in d.command
    assert switching.CPU_FLAGS == {**prefill.plan.CPU_FLAGS, **decode.plan.CPU_FLAGS}
    assert switching.CPU_ENV == {**prefill.plan.CPU_ENV, **decode.plan.CPU_ENV}
    off = plan(tmp_path, model_dir, "enable-pd-role-switch: false", role=Role.DECODE)
    assert "--enable-pd-role-switch" not in off.command and not off.registration.switch_enabled and off.flip is None


def test_switching_is_off_where_it_cannot_work_and_refused_when_asked_for_there(tmp_path, model_dir):
    fake = plan(tmp_path, model_dir, "disaggregation-transfer-backend: fake", role=Role.DECODE)
    assert not fake.registration.switch_enabled and "--enable-pd-role-switch" not in fake.command
    with pytest.raises(ConfigError, match="needs a Mooncake transfer backend"):
        plan(tmp_path, model_dir, "disaggregation-transfer-backend: fake\nenable-pd-role-switch: true",
             role=Role.DECODE)
    with pytest.raises(ConfigError, match="clears its HiCache storage"):
        switching.decide(SGLangOptions(sglang_parser()), ClusterSettings(role_switch=True, kv_store=str(tmp_path)),
                         cpu=True, role=Role.PREFILL)


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


LAUNCHER = textwrap.dedent("""
    import sys, threading
    from pdcluster.worker.supervisor import Supervisor
    s = Supervisor([sys.executable, "-c", "import time; time.sleep(600)"], env=None,
                   on_restart=lambda proc: print("restarted", proc.pid, flush=True))
    threading.Timer(1.0, s.restart).start()
    sys.exit(s.run(while_running=lambda proc: print("started", proc.pid, flush=True)))
""")


def test_the_supervisor_restarts_sglang_with_the_same_command_and_still_stops_cleanly():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        first = int(launcher.stdout.readline().split()[1])  # type: ignore[union-attr]
        second = int(launcher.stdout.readline().split()[1])  # type: ignore[union-attr]
        assert first != second
        assert until(lambda: not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie", timeout=10)
        assert psutil.Process(second).cmdline()[-1] == "import time; time.sleep(600)"
        launcher.terminate()
        launcher.wait(timeout=30)
        assert until(lambda: not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie", timeout=10)
    finally:
        launcher.kill()


MID_FLIP = textwrap.dedent("""
    import sys, threading
    from pdcluster.worker.supervisor import Supervisor
    s = Supervisor([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))", "1"], env=None,
                   on_restart=lambda proc: print("restarted", flush=True))
    s.mid_flip.set()  # a flip has SGLang mid-switch: it exits after 1 s; the flip asks for the restart only at 3 s
    threading.Timer(3.0, lambda: (s.restart(), s.mid_flip.clear())).start()
    sys.exit(s.run())
""")


def test_sglang_exiting_mid_flip_waits_for_the_flips_restart_instead_of_ending_the_worker():
    launcher = subprocess.Popen([sys.executable, "-c", MID_FLIP], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert launcher.stdout.readline().strip() == "restarted"  # type: ignore[union-attr]
        assert launcher.wait(timeout=30) == 0  # the restarted one ran its second and exited, the flip over: the end
    finally:
        launcher.kill()
