"""SGLang plugin: lets HiCache (host KV tier + storage backends such as `file`) run on a machine without CUDA.

Entry point `pdcluster_cpu_hicache` in group `sglang.srt.plugins` (pyproject.toml). SGLang's load_plugins() calls
register() in the launcher and in every scheduler/detokenizer process. It does nothing unless the environment has
PDCLUSTER_CPU_HICACHE=1 (set by pdcluster's launcher only for CPU workers with HiCache on) and torch sees no CUDA
device. When active it first checks every SGLang internal it adapts (internals.check), then:
  1. builds every HiCache host pool with pin_memory=False (pinning needs a CUDA driver; this also covers the file
     backend's read buffer, which follows the pool's setting);
  2. binds the three "direct" transfer ops, which SGLang imports from sgl_kernel only on CUDA/ROCm/XPU, to torch
     index copies (ops.py), for the layer_first and page_first_direct layouts;
  3. refuses, when the HiCache controller is built, any io backend but `direct` and any other layout;
  4. lowers the host RAM SGLang holds back from every host pool's budget from 10 GiB to 1 GiB: on CPU the device KV
     pool already lives in that RAM (internals.RESERVE).
An internal missing or changed stops the process at plugin load with a message naming it and the SGLang version.
"""

from __future__ import annotations

from pdcluster.plugins.sglang_plugin import CpuPlugin

PLUGIN = CpuPlugin("cpu_hicache", "PDCLUSTER_CPU_HICACHE", on_cuda="HiCache kernels")
ENV_VAR, register = PLUGIN.env_var, PLUGIN.register  # register: the entry point
