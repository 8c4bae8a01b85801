"""SGLang plugin: the prefill's Mooncake transfer loop survives SGLang 0.5.23's clean-up race on CPU.

The race (seen in 2 of the last 4 runs of the e2e suite, always under load): `MooncakeKVManager.transfer_worker`
tests `kv_chunk.room not in self.request_status` and then reads `self.check_status(kv_chunk.room)`; the scheduler
thread clears a concluded or aborted room in between, the read raises KeyError, and the whole transfer thread ends
("Transfer thread failed because of <room>. Prefill instance ... is dead"). Every later hand-off queued on that
thread then fails (pdcluster/plugins/thread_guard.py ends such a worker, which costs the requests it held and a
restart).

What a missing room means at each of those reads is what the test just before it says: the room is gone, the
chunk's work is over. So when the loop ends with exactly that (the RuntimeError SGLang raises from a KeyError whose
room is no longer in `request_status`), this plugin logs it and runs the loop again on the same queue; any other
exception still ends the thread (and the worker, by the guard). What the interrupted iteration had not done yet is
bookkeeping for a room that no longer exists (a `transfer_infos` entry at most).

Entry point `pdcluster_cpu_transfer_race` in group `sglang.srt.plugins`. Active only with
PDCLUSTER_CPU_TRANSFER_RACE=1 (the launcher sets it for CPU workers) and no CUDA device, where it was seen and where
every test runs; on a GPU the guard alone applies. The loop is compared by a fingerprint of its code: SGLang changing
it stops the worker at start, naming it, rather than being wrapped unseen.
"""

from __future__ import annotations

from pdcluster.plugins.sglang_plugin import CpuPlugin

PLUGIN = CpuPlugin("cpu_transfer_race", "PDCLUSTER_CPU_TRANSFER_RACE",
                   on_cuda="transfer loop (only pdcluster's thread guard applies)")
ENV_VAR, register = PLUGIN.env_var, PLUGIN.register  # register: the entry point
