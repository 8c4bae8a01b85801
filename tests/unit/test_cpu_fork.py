"""pdcluster/plugins/cpu_fork: on a CPU, SGLang's scheduler and detokenizer are forked from the launcher (no second
import of SGLang per child); the plugin wraps exactly the SGLang function that forces `spawn`, and refuses a changed
one."""

from __future__ import annotations

import multiprocessing
from importlib.metadata import entry_points

import pytest

from pdcluster.plugins import sglang_plugin
from pdcluster.plugins.cpu_fork import internals
from pdcluster.worker.environment import _cpu_env


def test_after_sglang_forces_spawn_the_next_processes_are_forked(monkeypatch):
    monkeypatch.setattr(multiprocessing.context, "_default_context", multiprocessing.context.DefaultContext(
        multiprocessing.context._concrete_contexts["spawn"]))  # restored after the test

    def set_envs_and_config(server_args):  # what SGLang's does about processes
        multiprocessing.set_start_method("spawn", force=True)
        return server_args

    wrapped = internals.forking(set_envs_and_config)
    assert wrapped("args") == "args"
    assert multiprocessing.get_start_method() == "fork"
    assert wrapped.pdcluster_wrapped is set_envs_and_config


def test_sglangs_own_function_is_the_one_it_was_written_for_and_is_wrapped_once(monkeypatch):
    from sglang.srt.entrypoints import engine

    monkeypatch.setattr(engine, "_set_envs_and_config", engine._set_envs_and_config)
    original = engine._set_envs_and_config
    assert internals.apply() == ["sglang.srt.entrypoints.engine._set_envs_and_config"]
    assert engine._set_envs_and_config.pdcluster_wrapped is original
    assert internals.apply() == []  # a child loading the plugins again


def test_a_changed_function_stops_the_worker_naming_it(monkeypatch):
    from sglang.srt.entrypoints import engine

    def _set_envs_and_config(server_args):
        multiprocessing.set_start_method("forkserver", force=True)

    monkeypatch.setattr(engine, "_set_envs_and_config", _set_envs_and_config)
    with pytest.raises(sglang_plugin.IncompatibleSGLang, match="_set_envs_and_config has changed"):
        internals.apply()


def test_the_launcher_turns_it_on_for_cpu_workers_and_sglang_finds_it():
    assert _cpu_env(_settings(), {}, {})["PDCLUSTER_CPU_FORK"] == "1"
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("pdcluster_cpu_fork") == "pdcluster.plugins.cpu_fork:register"


def test_off_without_its_variable_sglang_keeps_spawn(monkeypatch):
    from sglang.srt.entrypoints import engine

    from pdcluster.plugins.cpu_fork import register

    monkeypatch.setattr(engine, "_set_envs_and_config", engine._set_envs_and_config)
    monkeypatch.delenv("PDCLUSTER_CPU_FORK", raising=False)
    register()
    assert not hasattr(engine._set_envs_and_config, "pdcluster_wrapped")


def _settings():
    from pdcluster.worker.settings import ClusterSettings

    return ClusterSettings()
