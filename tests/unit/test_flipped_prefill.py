"""pdcluster/plugins/flipped_prefill: a decode's cached connection to a prefill is checked against the prefill's KV
bootstrap server at most every REVALIDATE_AFTER seconds and dropped when the prefill's KV manager moved (a role flip
and back), so SGLang connects and registers anew instead of waiting out its 60 s KV timeout."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from pdcluster.plugins.flipped_prefill import internals

OLD, NEW = {"rank_ip": "10.0.0.1", "rank_port": 40001}, {"rank_ip": "10.0.0.1", "rank_port": 40777}


class FakeManager:
    def __init__(self) -> None:
        self.connection_pool: dict[str, list[dict]] = {}
        self.connection_lock = threading.Lock()


class FakeReceiver:
    """What SGLang's CommonKVReceiver holds when it calls _setup_bootstrap_infos (TP, CP, PP of 1)."""

    def __init__(self, manager: FakeManager, server: dict) -> None:
        self.kv_mgr, self.server = manager, server
        self.bootstrap_addr, self.prefill_dp_rank, self.target_tp_rank = "10.0.0.1:8999", 0, 0
        self.target_cp_ranks, self.target_tp_ranks, self.target_pp_ranks = [0], [0], [0]
        self.asked = 0

    def _get_bootstrap_info_from_server(self, dp, cp, tp, pp):
        self.asked += 1
        return None if self.server.get("down") else dict(self.server["info"])


def sglang_setup(receiver: FakeReceiver) -> list[dict]:
    """SGLang's behaviour: a cached entry is used as it is; a missing one is fetched (and registered) and cached."""
    key = "10.0.0.1:8999_0_0_0"
    pool = receiver.kv_mgr.connection_pool
    if key not in pool:
        pool[key] = [receiver._get_bootstrap_info_from_server(0, 0, 0, 0)]
    return pool[key]


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(internals.time, "monotonic", lambda: now[0])
    return now


def test_a_prefill_flipped_and_back_is_connected_anew_and_a_steady_one_asked_at_most_every_half_second(clock):
    setup, manager, server = internals.revalidating(sglang_setup), FakeManager(), {"info": OLD}
    first = FakeReceiver(manager, server)
    assert setup(first) == [OLD] and first.asked == 1  # SGLang's own fetch
    clock[0] += 0.1
    again = FakeReceiver(manager, server)
    assert setup(again) == [OLD] and again.asked == 0  # filled just now: not asked
    clock[0] += 1.0
    steady = FakeReceiver(manager, server)
    assert setup(steady) == [OLD] and steady.asked == 1  # checked, current, kept
    server["info"] = NEW  # the prefill flipped to decode and back: a new KV manager on a new port
    clock[0] += 2.5
    after_flip = FakeReceiver(manager, server)
    assert setup(after_flip) == [NEW] and after_flip.asked == 2  # the check, then SGLang's own fetch
    clock[0] += 0.1
    assert setup(FakeReceiver(manager, server)) == [NEW]


def test_a_prefill_that_does_not_answer_keeps_its_entry_for_sglangs_heartbeat_to_judge(clock):
    setup, manager, server = internals.revalidating(sglang_setup), FakeManager(), {"info": OLD}
    setup(FakeReceiver(manager, server))
    server["down"] = True
    clock[0] += 5
    assert setup(FakeReceiver(manager, server)) == [OLD]


def test_sglangs_own_method_is_the_one_it_was_written_for_and_is_wrapped_once(monkeypatch):
    from sglang.srt.disaggregation.common import conn

    original = conn.CommonKVReceiver._setup_bootstrap_infos
    monkeypatch.setattr(conn.CommonKVReceiver, "_setup_bootstrap_infos", original)
    assert internals.apply() == [f"{internals.MODULE}.CommonKVReceiver._setup_bootstrap_infos"]
    assert conn.CommonKVReceiver._setup_bootstrap_infos.pdcluster_wrapped is original
    assert internals.apply() == []  # SGLang loads plugins again in each child process


def test_a_changed_method_stops_the_worker_naming_it(monkeypatch):
    from sglang.srt.disaggregation.common import conn

    def _setup_bootstrap_infos(self):
        return None  # a method SGLang has rewritten (the flip handled there, perhaps)

    monkeypatch.setattr(conn.CommonKVReceiver, "_setup_bootstrap_infos", _setup_bootstrap_infos)
    with pytest.raises(SystemExit, match=r"CommonKVReceiver\._setup_bootstrap_infos has changed"):
        internals.apply()


def test_sglang_loads_it_when_the_launcher_sets_its_variable_and_not_otherwise(monkeypatch):
    from sglang.srt.disaggregation.common import conn

    from pdcluster.plugins import flipped_prefill

    monkeypatch.setattr(conn.CommonKVReceiver, "_setup_bootstrap_infos", conn.CommonKVReceiver._setup_bootstrap_infos)
    monkeypatch.delenv(flipped_prefill.ENV_VAR, raising=False)
    flipped_prefill.register()
    assert not hasattr(conn.CommonKVReceiver._setup_bootstrap_infos, "pdcluster_wrapped")
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.disaggregation.common import conn; "
            "print(hasattr(conn.CommonKVReceiver._setup_bootstrap_infos, 'pdcluster_wrapped'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", flipped_prefill.ENV_VAR: "1"})
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
