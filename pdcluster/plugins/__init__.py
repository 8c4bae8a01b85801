"""pdcluster's SGLang plugins, which SGLang itself loads in each of its processes through the `sglang.srt.plugins`
entry points (pyproject.toml): thread_guard (a worker whose KV-transfer thread died ends) and the CPU adaptations
cpu_attention, cpu_fork, cpu_hicache, cpu_idle_yield, cpu_seeded_sampling and cpu_transfer_race, each wired by
sglang_plugin.py's `register` (on only with its variable and no CUDA; refusing to start when an SGLang internal it
adapts has changed);
and cpu_shim/, the stand-in `sgl_kernel` the worker launcher puts on a CPU worker's path. They run inside SGLang, so
they import no other room of pdcluster, and none imports them."""
