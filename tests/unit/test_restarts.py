"""The restart policy (pdcluster/local/restarts.py) and the local cluster's supervisor that applies it, with fake clocks
and fake processes: no sleeping through backoffs, no SGLang."""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from pdcluster.local.cluster import LocalCluster, hold_pid
from pdcluster.local.process import Process
from pdcluster.local.restarts import Backoff, RestartPolicy
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from tests.helpers import until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def crash(backoff: Backoff, clock: Clock, ran: float):
    backoff.started()
    clock.now += ran
    decision = backoff.exited()
    clock.now += decision.delay
    return decision


def test_backoff_starts_at_one_second_doubles_and_stops_at_the_cap():
    clock = Clock()
    backoff = Backoff(RestartPolicy(initial=1, cap=30, loop_exits=100), clock)
    delays = [crash(backoff, clock, ran=5).delay for _ in range(8)]
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.restarts == 8


def test_a_run_that_lasted_resets_the_backoff():
    clock = Clock()
    backoff = Backoff(RestartPolicy(initial=1, cap=30, stable_after=60), clock)
    assert [crash(backoff, clock, ran=2).delay for _ in range(3)] == [1, 2, 4]
    assert crash(backoff, clock, ran=61).delay == 1  # it had settled: this crash is news
    assert crash(backoff, clock, ran=2).delay == 2


def test_five_exits_in_two_minutes_is_a_crash_loop_reported_once_and_held_at_the_cap():
    clock = Clock()
    backoff = Backoff(RestartPolicy(initial=1, cap=30, loop_exits=5, loop_window=120, stable_after=60), clock)
    decisions = [crash(backoff, clock, ran=1) for _ in range(8)]
    assert [d.crash_loop for d in decisions] == [False] * 4 + [True] * 4
    assert [d.loop_started for d in decisions] == [False] * 4 + [True] + [False] * 3
    assert [d.delay for d in decisions] == [1, 2, 4, 8, 30, 30, 30, 30]  # never spins, whatever the pattern
    assert decisions[4].exits_in_window == 5
    assert crash(backoff, clock, ran=61).crash_loop is False  # it stayed up: the loop is over


def test_exits_spread_over_more_than_the_window_are_no_loop():
    clock = Clock()
    backoff = Backoff(RestartPolicy(initial=1, cap=30, loop_exits=5, loop_window=120, stable_after=60), clock)
    decisions = [crash(backoff, clock, ran=45) for _ in range(6)]  # one exit every ~46-75 s
    assert not any(d.crash_loop for d in decisions)


def test_a_policy_that_could_spin_is_refused():
    with pytest.raises(ValueError):
        RestartPolicy(initial=0)
    with pytest.raises(ValueError):
        RestartPolicy(initial=10, cap=5)


# ----- the supervisor of pdcluster.local, on processes that are not components -----

FAST = RestartPolicy(initial=0.2, cap=0.8, loop_exits=3, loop_window=30, stable_after=30)


def fake_cluster(tmp_path: Path, lines: list[str]) -> LocalCluster:
    spec = LocalSpec(bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=1),
                     router=ComponentSpec(config="configs/router.yaml", port=2),
                     prefill=WorkerGroupSpec(config="x", count=0, first_port=1024),
                     decode=WorkerGroupSpec(config="x", count=0, first_port=1024))
    cluster = LocalCluster(spec, tmp_path, policy=FAST, report=lines.append)
    cluster.processes.clear()
    for name, code in (("sleeper", "import time; time.sleep(60)"), ("crasher", "raise SystemExit(3)")):
        cluster.processes[name] = Process(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", policy=FAST)
    return cluster




def test_a_killed_component_is_restarted_and_counted(tmp_path):
    lines: list[str] = []
    cluster = fake_cluster(tmp_path, lines)
    cluster.start()
    cluster.supervise(interval=0.02)
    try:
        sleeper = cluster.processes["sleeper"]
        first = sleeper.popen.pid
        sleeper.popen.kill()  # not through Process.signal: nobody asked it to stop
        assert until(lambda: sleeper.running and sleeper.popen.pid != first)
        assert cluster.restarts()["sleeper"] == 1
        assert any(line.startswith("sleeper exited (signal 9)") and "restart #1" in line for line in lines)
    finally:
        cluster.stop(timeout=5)


def test_a_crash_loop_is_reported_loudly_and_backs_off_to_the_cap(tmp_path):
    lines: list[str] = []
    cluster = fake_cluster(tmp_path, lines)
    cluster.start()
    cluster.supervise(interval=0.02)
    try:
        assert until(lambda: cluster.restarts()["crasher"] >= 4, timeout=30)
    finally:
        cluster.stop(timeout=5)
    loops = [line for line in lines if line.startswith("CRASH LOOP: crasher")]
    assert loops and "exited 3 times" in loops[0] and "every 1s" in loops[0]
    delays = [re.search(r"crasher exited \(status 3\).* restart #\d+ in (\d+)s", line) for line in lines]
    assert [m.group(1) for m in delays if m][:4] == ["0", "0", "1", "1"]  # 0.2 s, 0.4 s, then the cap (0.8 s)


def test_a_component_stopped_on_purpose_stays_down_until_started(tmp_path):
    lines: list[str] = []
    cluster = fake_cluster(tmp_path, lines)
    cluster.start()
    cluster.supervise(interval=0.02)
    try:
        sleeper = cluster.processes["sleeper"]
        sleeper.signal(signal.SIGTERM)  # asked to go
        sleeper.popen.wait(timeout=5)
        time.sleep(FAST.initial * 3)
        assert not sleeper.running and cluster.restarts()["sleeper"] == 0
        sleeper.start()
        assert sleeper.running and not sleeper.held
        # A test helper killing a launcher's tree by pid says so first (tests/e2e/conftest.py kill_tree).
        assert hold_pid(sleeper.popen.pid) == "sleeper"
        sleeper.popen.kill()
        sleeper.popen.wait(timeout=5)
        time.sleep(FAST.initial * 3)
        assert not sleeper.running and cluster.restarts()["sleeper"] == 0
        with cluster.held("sleeper"):  # released at the end of the block: the supervisor takes over again
            pass
        assert until(lambda: sleeper.running)
    finally:
        cluster.stop(timeout=5)
    assert not any(p.running for p in cluster.processes.values())


def test_stop_is_not_taken_for_a_crash(tmp_path):
    lines: list[str] = []
    cluster = fake_cluster(tmp_path, lines)
    del cluster.processes["crasher"]
    cluster.start()
    cluster.supervise(interval=0.02)
    cluster.stop(timeout=5)
    time.sleep(0.3)
    assert not cluster.processes["sleeper"].running and lines == []
