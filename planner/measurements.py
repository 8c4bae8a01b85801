"""The profiler's arithmetic (planner/profile.py), apart from its requests so that it can be checked on made-up
timings: a prefill point from single requests' times to first token, a decode point from concurrent streams' chunk
times. Medians are what the profile's model uses; the spread is kept beside each, so that a reader sees the noise."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pdcluster.common.capacity import DecodePoint, PrefillPoint

# One streamed chunk: (time it arrived, the request's completion tokens so far).
Chunk = tuple[float, int]


def prefill_point(prompt_tokens: int, ttfts: Sequence[float]) -> PrefillPoint:
    """Prompt tokens over the median time to first token of single requests of that length; the spread is the range
    of the repeats' own rates."""
    if not ttfts or min(ttfts) <= 0:
        raise ValueError(f"a prefill point needs positive times to first token, got {list(ttfts)}")
    rates = [prompt_tokens / t for t in ttfts]
    return PrefillPoint(prompt_tokens=prompt_tokens, tokens_per_s=prompt_tokens / statistics.median(ttfts),
                        spread=max(rates) - min(rates), samples=len(ttfts))


def token_gaps(chunks: Sequence[Chunk]) -> list[tuple[float, float]]:
    """(time of the chunk, seconds per token since the chunk before), once per token after the first: a chunk that
    brings n tokens after a gap of g seconds counts as n gaps of g / n."""
    out: list[tuple[float, float]] = []
    prev_t: float | None = None
    prev_n = 0
    for t, n in chunks:
        if prev_t is not None and n > prev_n > 0:
            out += [(t, (t - prev_t) / (n - prev_n))] * (n - prev_n)
        if n > prev_n:
            prev_t, prev_n = t, n
    return out


def full_batch_window(streams: Sequence[Sequence[Chunk]]) -> tuple[float, float]:
    """From the moment the last stream got its first token to the moment the first stream got its last one: the only
    time every stream was in the decode's batch at once."""
    firsts = [next(t for t, n in chunks if n > 0) for chunks in streams]
    lasts = [chunks[-1][0] for chunks in streams]
    return max(firsts), min(lasts)


def decode_point(batch: int, context_tokens: int, streams: Sequence[Sequence[Chunk]]) -> DecodePoint | None:
    """The median per-token gap of `batch` concurrent streams while all of them ran (p75 - p25 as the spread); None
    when that window holds no gap (the streams hardly overlapped: the point is not measured, not guessed)."""
    if len(streams) != batch or any(not any(n > 0 for _, n in chunks) for chunks in streams):
        return None
    start, end = full_batch_window(streams)
    gaps = [g for chunks in streams for t, g in token_gaps(chunks) if start < t <= end]
    if not gaps:
        return None
    quartiles = statistics.quantiles(gaps, n=4) if len(gaps) > 1 else [gaps[0]] * 3
    return DecodePoint(batch=batch, context_tokens=context_tokens, itl_s=statistics.median(gaps),
                       spread=quartiles[2] - quartiles[0], samples=len(gaps))


def fits_in_kv(batch: int, context_tokens: int, answer_tokens: int, kv_tokens: int | None, share: float = 0.9) -> bool:
    """Whether `batch` streams of this context and answer fit in `share` of a decode's KV pool at once (beyond it
    the decode queues some, and the cell would not measure that batch)."""
    return kv_tokens is None or batch * (context_tokens + answer_tokens) <= share * kv_tokens
