"""pdcluster/plugins/cpu_transfer_race: SGLang 0.5.23's transfer loop ends on a KeyError when the scheduler clears a
room between two of its reads; the plugin runs the loop again for exactly that, and for nothing else."""

from __future__ import annotations

import pytest

from pdcluster.plugins import sglang_plugin
from pdcluster.plugins.cpu_transfer_race import internals


class FakeManager:
    def __init__(self, request_status: dict):
        self.request_status = request_status


def ends_like_sglang(room: int) -> None:
    """What SGLang's loop raises (mooncake/conn.py: `except Exception as e: raise RuntimeError(...)`)."""
    try:
        raise KeyError(room)
    except Exception as e:  # as SGLang does: the KeyError is the RuntimeError's context
        raise RuntimeError(f"Transfer thread failed because of {e}. Prefill instance with bootstrap_port=19001 is "  # noqa: B904
                           "dead.")


def test_the_loop_goes_on_after_the_race_and_returns_what_it_returns():
    calls = []

    def loop(self, queue, executor, staging, index):
        calls.append((queue, index))
        if len(calls) < 3:
            ends_like_sglang(8753473380615765753)  # a room the scheduler cleared: not in request_status any more
        return "queue closed"

    wrapped = internals.surviving(loop)
    assert wrapped(FakeManager({}), "q", None, None, 0) == "queue closed"
    assert calls == [("q", 0)] * 3  # the same queue each time


@pytest.mark.parametrize("failure", ["room still there", "another key", "another error"])
def test_anything_else_still_ends_the_thread(failure):
    def loop(self, *args):
        if failure == "room still there":
            ends_like_sglang(7)
        if failure == "another key":
            try:
                raise KeyError("dst_ranks")
            except KeyError as e:
                raise RuntimeError(f"Transfer thread failed because of {e}.") from e
        raise RuntimeError("Mooncake session failed")

    with pytest.raises(RuntimeError):
        internals.surviving(loop)(FakeManager({7: "WaitingForInput"}))


def test_sglangs_own_loop_is_the_one_it_was_written_for_and_is_wrapped_once(monkeypatch):
    from sglang.srt.disaggregation.mooncake import conn

    monkeypatch.setattr(conn.MooncakeKVManager, "transfer_worker", conn.MooncakeKVManager.transfer_worker)
    original = conn.MooncakeKVManager.transfer_worker
    assert internals.apply() == [f"{internals.MODULE}.MooncakeKVManager.transfer_worker"]
    assert conn.MooncakeKVManager.transfer_worker.pdcluster_wrapped is original
    assert internals.apply() == []  # SGLang loads plugins again in each child process


def test_a_changed_loop_stops_the_worker_naming_it(monkeypatch):
    from sglang.srt.disaggregation.mooncake import conn

    def transfer_worker(self, queue, executor, staging_buffer, queue_index):
        return None  # a loop SGLang has rewritten (the race fixed, perhaps)

    monkeypatch.setattr(conn.MooncakeKVManager, "transfer_worker", transfer_worker)
    with pytest.raises(sglang_plugin.IncompatibleSGLang, match=r"MooncakeKVManager\.transfer_worker has changed"):
        internals.apply()
