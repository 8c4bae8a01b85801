"""SGLang plugin: CPU attention. Extend computes only the new tokens, so cache hits and chunked prefills on a CPU cost
what is new in them instead of the whole sequence's attention again; decode attends for the whole batch in one call,
not sequence after sequence.

Entry point `pdcluster_cpu_attention` in group `sglang.srt.plugins` (pyproject.toml). SGLang's load_plugins() calls
register() in the launcher and in every scheduler/detokenizer process. It does nothing unless the environment has
PDCLUSTER_CPU_ATTENTION=1 (set by pdcluster's launcher for CPU workers, `cluster.cpu_attention`, on by default) and
torch sees no CUDA device. When active it first checks every internal it relies on (internals.check), then replaces
`TorchNativeAttnBackend._run_sdpa_forward_extend` (the torch_native backend's extend attention, which the CPU profile
uses) with ops.extend for causal self-attention, and `_run_sdpa_forward_decode` with ops.decode for self-attention;
cross attention, encoder lengths, sliding windows and shapes the ops do not cover go to SGLang's own code unchanged.
An internal missing or changed stops the process at plugin load with a message naming it and the SGLang version.
"""

from __future__ import annotations

from pdcluster.plugins.sglang_plugin import CpuPlugin

PLUGIN = CpuPlugin("cpu_attention", "PDCLUSTER_CPU_ATTENTION", on_cuda="attention backends")
ENV_VAR, register = PLUGIN.env_var, PLUGIN.register  # register: the entry point
