"""The internals the seeded-sampling plugin adapts, checked first by fingerprint: SGLang 0.5.23's seeded sampler
`multinomial_with_seed` (replaced: its Triton hash runs on no CPU), the two samplers that call it by its module name
and the method that passes them the batch's seeds (relied on; the one that asserts on min_p with a seed, wrapped),
and `SamplingBatchInfo`'s making, merging and filtering of a batch's seeds (the first two wrapped)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from pdcluster.plugins.cpu_seeded_sampling import PLUGIN
from pdcluster.plugins.sglang_plugin import fingerprint, import_module

SAMPLER, BATCH_INFO = "sglang.srt.layers.sampler", "sglang.srt.sampling.sampling_batch_info"
# sha256 of ast.dump of each function without its docstring, as SGLang 0.5.23 ships it.
FINGERPRINTS = {
    "multinomial_with_seed": "3d62531844f1534bcac8e6d92dbb3709b9f0acffafbf533448d2d4c6d9208962",
    "sampling_from_probs_torch": "34990a2598b505bdb60203af85744c78677bd0a0967a833c0977c41dd52d5de6",
    "top_k_top_p_min_p_sampling_from_probs_torch": "82160feb7d13ab51cfd60268a1d03939347f8691ea1e79ce09421d8e39169918",
    "Sampler._sample_from_probs": "c3d01e3dd1d64a77ed1e671a0f7cf635c5b971377b6dcb6398a9252f73e9c020",
    "SamplingBatchInfo.from_schedule_batch": "ddc94de1a902d84f82c7988a7ce9c31be14daacf780b6f51d06c148db96e7373",
    "SamplingBatchInfo.merge_batch": "889d79376a802f75d084b0b3ca92e75b1eceb01cbecb5a56c61bbac011b995eb",
    "SamplingBatchInfo.filter_batch": "e3d4f712a056dacf28927f03773fbb900ad9d6d8bd56bac57ff854c96ac8e475",
}
WRITTEN_FOR = "0.5.23"
MASK64 = 2**64 - 1
_unseeded = random.Random()  # a row without a seed gets a random one: its sampling stays random


def _fail(what: str) -> NoReturn:
    PLUGIN.refuse(what, WRITTEN_FOR, ", or unset the variable (seeds are then ignored on CPU workers)")


def row_seed(seed: int, position: int) -> int:
    """A generator seed made of a row's seed and the token's position, by splitmix64's finaliser: nearby seeds and
    positions give unrelated noise."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def multinomial_with_seed(logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SGLang's, on a CPU: for each row, the index of the largest log-probability plus Gumbel noise (float64, as
    SGLang's), the noise drawn by a torch generator seeded by the row's seed and position. Shape (n, 1)."""
    rows, vocab = logprobs.shape
    chosen = torch.empty((rows, 1), dtype=torch.int64, device=logprobs.device)
    generator = torch.Generator(device="cpu")
    for row, (row_seed_value, position) in enumerate(zip(seed.tolist(), positions.tolist(), strict=True)):
        generator.manual_seed(row_seed(row_seed_value, position))
        noise = torch.rand(vocab, generator=generator, dtype=torch.float64)
        noise.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_().log_().neg_()  # -log(-log(u))
        chosen[row, 0] = torch.argmax(noise.add_(logprobs[row].to(torch.float64)))
    return chosen


def random_seeds(rows: int, device: Any) -> torch.Tensor:
    return torch.tensor([_unseeded.getrandbits(63) for _ in range(rows)], dtype=torch.int64, device=device)


def request_seeds(reqs: list[Any], device: Any) -> torch.Tensor:
    """Each request's seed, a random one for a request without."""
    seeds = [r.sampling_params.sampling_seed for r in reqs]
    return torch.tensor([s if s is not None else _unseeded.getrandbits(63) for s in seeds], dtype=torch.int64,
                        device=device)


def seeding(from_schedule_batch: Callable[..., Any]) -> Callable[..., Any]:
    """`from_schedule_batch`, with the rows' seeds where any request of the batch has one (SGLang sets them only
    under deterministic inference)."""

    @functools.wraps(from_schedule_batch)
    def wrapper(cls: type, batch: Any, vocab_size: int) -> Any:
        info = from_schedule_batch(cls, batch, vocab_size)
        if info.sampling_seed is None and any(r.sampling_params.sampling_seed is not None for r in batch.reqs):
            info.sampling_seed = request_seeds(batch.reqs, info.temperatures.device)
        return info

    wrapper.pdcluster_wrapped = from_schedule_batch  # type: ignore[attr-defined]
    return wrapper


def aligning(merge_batch: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`merge_batch`, the side without seeds given random ones first (SGLang merges seeds only when both sides have
    them: the merged batch would keep one side's alone, fewer than its rows)."""

    @functools.wraps(merge_batch)
    def wrapper(self: Any, other: Any) -> Any:
        if (self.sampling_seed is None) != (other.sampling_seed is None):
            for info in (self, other):
                if info.sampling_seed is None:
                    info.sampling_seed = random_seeds(len(info), info.temperatures.device)
        return merge_batch(self, other)

    wrapper.pdcluster_wrapped = merge_batch  # type: ignore[attr-defined]
    return wrapper


def min_p_seeded(sample: Callable[..., Any]) -> Callable[..., Any]:
    """SGLang's top-k/top-p/min-p sampler, whose seeded path asserts on min_p (its weights would need renormalising
    for a multinomial; Gumbel-max needs none): a seeded batch's min_p is applied first, on a copy of the
    probabilities (the answer's logprobs are read from them), and the sampler asked for top-k and top-p only. The
    same tokens survive: min_p's threshold is a share of the largest probability, which top-k and top-p keep, and the
    tokens below it are the least likely, whose removal changes no cumulative sum top-p reads before them."""

    @functools.wraps(sample)
    def wrapper(probs: torch.Tensor, top_ks: Any, top_ps: Any, min_ps: torch.Tensor, need_min_p_sampling: bool,
                sampling_seed: Any, positions: Any, **kwargs: Any) -> Any:
        if need_min_p_sampling and sampling_seed is not None:
            threshold = probs.max(dim=-1, keepdim=True).values * min_ps.view(-1, 1)
            probs, need_min_p_sampling = probs.masked_fill(probs < threshold, 0.0), False
        return sample(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions, **kwargs)

    wrapper.pdcluster_wrapped = sample  # type: ignore[attr-defined]
    return wrapper


def _current(sampler: Any, info_cls: Any) -> dict[str, Any]:
    """Each fingerprinted function as SGLang has it now (None: missing)."""
    made = info_cls.__dict__.get("from_schedule_batch")
    return {
        "multinomial_with_seed": getattr(sampler, "multinomial_with_seed", None),
        "sampling_from_probs_torch": getattr(sampler, "sampling_from_probs_torch", None),
        "top_k_top_p_min_p_sampling_from_probs_torch": getattr(sampler, "top_k_top_p_min_p_sampling_from_probs_torch",
                                                               None),
        "Sampler._sample_from_probs": getattr(getattr(sampler, "Sampler", None), "_sample_from_probs", None),
        "SamplingBatchInfo.from_schedule_batch": made.__func__ if isinstance(made, classmethod) else None,
        "SamplingBatchInfo.merge_batch": getattr(info_cls, "merge_batch", None),
        "SamplingBatchInfo.filter_batch": getattr(info_cls, "filter_batch", None),
    }


def apply() -> list[str]:
    sampler = import_module(SAMPLER, _fail)
    info_cls = getattr(import_module(BATCH_INFO, _fail), "SamplingBatchInfo", None)
    if info_cls is None:
        _fail(f"{BATCH_INFO}.SamplingBatchInfo is missing")
    if getattr(info_cls.merge_batch, "pdcluster_wrapped", None) is not None:
        return []  # SGLang loads plugins again in each child it forks
    current = _current(sampler, info_cls)
    for name, found in current.items():
        if found is None:
            _fail(f"{name} is missing")
        if fingerprint(found) != FINGERPRINTS[name]:
            _fail(f"{name} has changed (fingerprint {fingerprint(found)})")
    # Module attributes: SGLang's samplers call both by their module name.
    setattr(sampler, "multinomial_with_seed", multinomial_with_seed)  # noqa: B010
    setattr(sampler, "top_k_top_p_min_p_sampling_from_probs_torch",  # noqa: B010
            min_p_seeded(current["top_k_top_p_min_p_sampling_from_probs_torch"]))
    info_cls.from_schedule_batch = classmethod(seeding(current["SamplingBatchInfo.from_schedule_batch"]))
    info_cls.merge_batch = aligning(current["SamplingBatchInfo.merge_batch"])
    return [f"{SAMPLER}.multinomial_with_seed", f"{SAMPLER}.top_k_top_p_min_p_sampling_from_probs_torch",
            f"{BATCH_INFO}.SamplingBatchInfo.from_schedule_batch", f"{BATCH_INFO}.SamplingBatchInfo.merge_batch"]
