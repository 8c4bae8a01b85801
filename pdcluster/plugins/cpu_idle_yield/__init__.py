"""SGLang plugin: on a CPU, a PD scheduler that waits on a hand-off waits, instead of spinning a core.

SGLang 0.5.23's scheduler loop calls `Scheduler.on_idle` when it has no batch to run. Fully idle, it sleeps until a
request comes (`--sleep-on-idle`); but a prefill whose requests wait on their decode's handshake or their KV transfer,
or a decode whose requests wait for their KV, is "not fully idle", and SGLang then only yields the GIL
(`time.sleep(0)`) and loops again: a whole core, for as long as the other worker computes. On a GPU host that core is
spare. On a CPU host it is one of the cores the other worker's torch threads compute on, and every OpenMP barrier of
theirs waits for a thread the spinning loop displaced. Measured on SmolLM2 on 2 cores: a decode step went from
~60 ms to ~420 ms while the prefill spun on its bootstrap queue, and the handshakes themselves took seconds.

With this plugin the waiting scheduler waits up to 1 ms on its request sockets (SGLang's own idle poller: a new
request still wakes it at once) before it looks at its queues again: a hand-off is seen at most 1 ms later.

Entry point `pdcluster_cpu_idle_yield` in group `sglang.srt.plugins`. Active only with PDCLUSTER_CPU_IDLE_YIELD=1
(the launcher sets it for CPU workers) and no CUDA device. The two methods it relies on are compared by a fingerprint
of their code: SGLang changing either stops the worker at start, naming it, rather than being wrapped unseen.
"""

from __future__ import annotations

from pdcluster.plugins.sglang_plugin import CpuPlugin

PLUGIN = CpuPlugin("cpu_idle_yield", "PDCLUSTER_CPU_IDLE_YIELD", on_cuda="busy polling while a hand-off is pending")
ENV_VAR, register = PLUGIN.env_var, PLUGIN.register  # register: the entry point
