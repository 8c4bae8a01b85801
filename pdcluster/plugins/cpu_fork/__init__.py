"""SGLang plugin: on a CPU, SGLang's scheduler and detokenizer processes are forked from the launcher, not spawned.

SGLang 0.5.23 starts them with multiprocessing's `spawn` (`_set_envs_and_config` forces it: CUDA cannot be used
in a forked child). A spawned child is a new interpreter that imports torch and most of SGLang again (~10-15 s of a
core each, two children per worker), though its parent has just imported the same modules. On a CPU there is no CUDA
context to protect, and a worker start is mostly those imports: where the tests and `make up` wait for many starts
on a few cores, forking gives the children what the parent imported. The parent has run no torch computation and
opened no ZMQ socket when the children start (SGLang starts them before its tokenizer manager), so a forked child
begins as a spawned one would, less the imports.

Entry point `pdcluster_cpu_fork` in group `sglang.srt.plugins`. Active only with PDCLUSTER_CPU_FORK=1 (the launcher
sets it for CPU workers) and no CUDA device; on a GPU SGLang keeps `spawn`. The function it wraps is compared by a
fingerprint of its code: SGLang changing it stops the worker at start, naming it, rather than being wrapped unseen.
"""

from __future__ import annotations

from pdcluster.plugins.sglang_plugin import CpuPlugin

PLUGIN = CpuPlugin("cpu_fork", "PDCLUSTER_CPU_FORK", on_cuda="spawned processes")
ENV_VAR, register = PLUGIN.env_var, PLUGIN.register  # register: the entry point
