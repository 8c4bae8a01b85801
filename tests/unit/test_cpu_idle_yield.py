"""pdcluster/plugins/cpu_idle_yield: on a CPU, a PD scheduler with only hand-offs pending waits on its idle poller for a
millisecond instead of spinning a core; a fully idle one is left to SGLang's own sleep; the plugin wraps exactly the
SGLang methods it was written for, once, and refuses changed ones."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from pdcluster.plugins import sglang_plugin
from pdcluster.plugins.cpu_idle_yield import internals
from pdcluster.worker.environment import _cpu_env


class Poller:
    def __init__(self):
        self.polls: list[int] = []

    def poll(self, timeout_ms: int) -> list:
        self.polls.append(timeout_ms)
        return []


class Sleeper:
    def __init__(self):
        self.poller = Poller()


class Scheduler:
    """What the wrapper reads of SGLang's: whether it is fully idle, and its idle sleeper (None without
    --sleep-on-idle)."""

    def __init__(self, fully_idle: bool, sleeper: Sleeper | None):
        self.fully_idle, self.idle_sleeper, self.on_idle_calls = fully_idle, sleeper, 0

    def is_fully_idle(self) -> bool:
        return self.fully_idle

    def on_idle(self) -> None:
        self.on_idle_calls += 1


def test_a_scheduler_waiting_on_a_hand_off_waits_a_millisecond_on_its_poller():
    scheduler = Scheduler(fully_idle=False, sleeper=Sleeper())
    internals.waiting(Scheduler.on_idle)(scheduler)
    assert scheduler.on_idle_calls == 1 and scheduler.idle_sleeper.poller.polls == [internals.WAIT_MS]


def test_a_fully_idle_scheduler_is_left_to_sglangs_own_sleep():
    scheduler = Scheduler(fully_idle=True, sleeper=Sleeper())
    internals.waiting(Scheduler.on_idle)(scheduler)
    assert scheduler.on_idle_calls == 1 and scheduler.idle_sleeper.poller.polls == []


def test_without_an_idle_sleeper_it_sleeps_as_long(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(internals.time, "sleep", slept.append)
    internals.waiting(Scheduler.on_idle)(Scheduler(fully_idle=False, sleeper=None))
    assert slept == [internals.WAIT_MS / 1000]


def test_sglangs_own_methods_are_the_ones_it_was_written_for_and_are_wrapped_once(monkeypatch):
    from sglang.srt.managers.scheduler import Scheduler as SGLangScheduler

    monkeypatch.setattr(SGLangScheduler, "on_idle", SGLangScheduler.on_idle)
    original = SGLangScheduler.on_idle
    assert internals.apply() == ["sglang.srt.managers.scheduler.Scheduler.on_idle"]
    assert SGLangScheduler.on_idle.pdcluster_wrapped is original
    assert internals.apply() == []  # a child loading the plugins again


@pytest.mark.parametrize("name", ["on_idle", "is_fully_idle"])
def test_a_changed_method_stops_the_worker_naming_it(monkeypatch, name):
    from sglang.srt.managers.scheduler import Scheduler as SGLangScheduler

    def changed(self):
        return True

    monkeypatch.setattr(SGLangScheduler, name, changed)
    with pytest.raises(sglang_plugin.IncompatibleSGLang, match=f"Scheduler.{name} has changed"):
        internals.apply()


def test_the_launcher_turns_it_on_for_cpu_workers_and_sglang_finds_it():
    from pdcluster.worker.settings import ClusterSettings

    assert _cpu_env(ClusterSettings(), {}, {})["PDCLUSTER_CPU_IDLE_YIELD"] == "1"
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("pdcluster_cpu_idle_yield") == "pdcluster.plugins.cpu_idle_yield:register"


def test_off_without_its_variable(monkeypatch):
    from sglang.srt.managers.scheduler import Scheduler as SGLangScheduler

    from pdcluster.plugins.cpu_idle_yield import register

    monkeypatch.setattr(SGLangScheduler, "on_idle", SGLangScheduler.on_idle)
    monkeypatch.delenv("PDCLUSTER_CPU_IDLE_YIELD", raising=False)
    register()
    assert not hasattr(SGLangScheduler.on_idle, "pdcluster_wrapped")
