"""SGLang plugin: on a CPU, a request's `sampling_seed` (OpenAI's `seed`) decides its sampled tokens.

SGLang 0.5.23 samples by a request's seed only under `--enable-deterministic-inference` (which it refuses with the
CPU's torch_native attention), and its seeded sampler hashes with a Triton kernel, which runs on no CPU. Without this
plugin a CPU worker ignores the seed: the same seed on the same prompt gives other tokens each time, and evaluation
harnesses that send one (lm-eval's local-completions) cannot reproduce a run.

With it, a batch with a seeded request carries every row's seed (SGLang's own `sampling_seed` tensor: a random one for
a row without) through SGLang's seeded path (Gumbel-max over the token's log-probabilities), whose noise here comes
from a torch generator seeded by the row's seed and the token's position instead of the Triton hash. The same seed on
the same prompt gives the same tokens whatever else is batched with it, as long as the logits are the same: on an
idle cluster (batching on a busy one may change the logits in their last bits). Batches without a seeded request are
sampled as before. `min_p` stays honoured: applied before SGLang's seeded sampler, which asserts on it.

Entry point `pdcluster_cpu_seeded_sampling` in group `sglang.srt.plugins`. Active only with
PDCLUSTER_CPU_SEEDED_SAMPLING=1 (the launcher sets it for CPU workers) and no CUDA device. Every SGLang function it
replaces, wraps or relies on is compared by a fingerprint of its code: SGLang changing one stops the worker at start,
naming it.
"""

from __future__ import annotations

from pdcluster.plugins.sglang_plugin import CpuPlugin

PLUGIN = CpuPlugin("cpu_seeded_sampling", "PDCLUSTER_CPU_SEEDED_SAMPLING",
                   on_cuda="seeded sampler (with --enable-deterministic-inference)")
ENV_VAR, register = PLUGIN.env_var, PLUGIN.register  # register: the entry point
