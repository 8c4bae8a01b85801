"""The one capacity model of a worker: how fast a prefill turns a prompt into its first token, how long a decode step
takes for a batch at a context length, and what a role flip costs, as measured on one machine (`make profile`:
planner/profile.py). The planner sizes each role with it, the planner's simulator runs on it, and the router's
admission predicts a prefill's queue wait with it: one model, so that the three agree.

Measured points are kept as measured: nothing assumes that throughput or ITL is monotone (a noisy point stays noisy
and shows). Between points values are interpolated piecewise linearly; outside the measured range they are held at the
nearest end (clamped), never extrapolated, and no answer speaks of a decode batch larger than any measured one.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y at `x` on the piecewise linear curve through (xs, ys), xs strictly increasing; outside [xs[0], xs[-1]] the
    end's y (clamped: a curve measured from 64 to 4096 tokens says nothing of 8192, so it is not stretched there)."""
    if not xs or len(xs) != len(ys):
        raise ValueError(f"interpolate needs as many ys as xs, and at least one point (got {len(xs)} and {len(ys)})")
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise ValueError(f"interpolate needs strictly increasing xs, got {list(xs)}")
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    right = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class _Strict(BaseModel):
    # A profile is written by a program and read by several: a misspelt field is a bug to hear about, not to drop.
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillPoint(_Strict):
    """One prompt length's prefill rate: prompt tokens over the median time to first token of single requests."""

    prompt_tokens: int = Field(ge=1)
    tokens_per_s: float = Field(gt=0)
    spread: float = Field(default=0.0, ge=0)  # max - min of tokens/s over the repeats: the noise, kept
    samples: int = Field(default=1, ge=1)


class DecodePoint(_Strict):
    """The median inter-token latency of `batch` concurrent streams whose context is about `context_tokens` long."""

    batch: int = Field(ge=1)
    context_tokens: int = Field(ge=1)
    itl_s: float = Field(gt=0)
    spread: float = Field(default=0.0, ge=0)  # p75 - p25 of the per-token gaps, in seconds
    samples: int = Field(default=1, ge=1)  # per-token gaps measured


class Profile(_Strict):
    """What one worker of `model` on `hardware` can do, as measured at `measured_at` by `method`."""

    model: str = Field(min_length=1)
    hardware: str = Field(min_length=1)
    measured_at: datetime
    method: str = Field(min_length=1)
    prefill: tuple[PrefillPoint, ...] = Field(min_length=1)
    decode: tuple[DecodePoint, ...] = Field(min_length=1)
    # From the end of the drain to serving in the new role; None: never measured (a user of it says which default
    # it takes instead, and that it is one).
    flip_seconds: float | None = Field(default=None, gt=0)
    # A decode's KV pool in tokens (SGLang's max_total_num_tokens): what memory lets it hold at once.
    decode_kv_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ordered_and_unique(self) -> Profile:
        prompts = sorted(p.prompt_tokens for p in self.prefill)
        if len(set(prompts)) != len(prompts):
            raise ValueError(f"two prefill points at one prompt length: {prompts}")
        cells = sorted((p.context_tokens, p.batch) for p in self.decode)
        if len(set(cells)) != len(cells):
            raise ValueError(f"two decode points at one (context, batch): {cells}")
        # Sorted once here, so that every question below reads ordered points.
        object.__setattr__(self, "prefill", tuple(sorted(self.prefill, key=lambda p: p.prompt_tokens)))
        object.__setattr__(self, "decode", tuple(sorted(self.decode, key=lambda p: (p.context_tokens, p.batch))))
        return self

    # ----- files -----

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    def dump(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")

    # ----- prefill -----

    def prefill_tokens_per_s(self, prompt_tokens: float) -> float:
        return interpolate([p.prompt_tokens for p in self.prefill], [p.tokens_per_s for p in self.prefill],
                           prompt_tokens)

    def prefill_seconds(self, prompt_tokens: float) -> float:
        """How long one prefill takes to bring a prompt of this length to its first token, alone."""
        if prompt_tokens <= 0:
            raise ValueError(f"a prompt has at least one token, not {prompt_tokens}")
        return prompt_tokens / self.prefill_tokens_per_s(prompt_tokens)

    def queue_wait_seconds(self, queued_tokens: float, mean_prompt_tokens: float | None = None) -> float:
        """How long a new prompt waits behind `queued_tokens` booked on a prefill: at the rate of prompts of
        `mean_prompt_tokens`, or, when the queue's lengths are not known, at the slowest measured rate (a wait
        predicted too long refuses a request early; one predicted too short fails it late)."""
        if queued_tokens < 0:
            raise ValueError(f"queued tokens cannot be negative: {queued_tokens}")
        if mean_prompt_tokens is None:
            rate = min(p.tokens_per_s for p in self.prefill)
        else:
            rate = self.prefill_tokens_per_s(mean_prompt_tokens)
        return queued_tokens / rate

    # ----- decode -----

    def _contexts(self) -> list[int]:
        return sorted({p.context_tokens for p in self.decode})

    def _at_context(self, context: int) -> list[DecodePoint]:
        return [p for p in self.decode if p.context_tokens == context]

    def _bracket(self, context: float) -> tuple[int, int]:
        """The measured contexts on either side of `context` (one of them twice at or beyond an end)."""
        contexts = self._contexts()
        if context <= contexts[0]:
            return contexts[0], contexts[0]
        if context >= contexts[-1]:
            return contexts[-1], contexts[-1]
        right = bisect.bisect_right(contexts, context)
        return contexts[right - 1], contexts[right]

    def decode_itl(self, batch: float, context_tokens: float) -> float:
        """Seconds per decode step of a batch of `batch` requests whose context is `context_tokens` long: along the
        batch at each of the two measured contexts around it, then between those two."""
        if batch < 1:
            raise ValueError(f"a decode batch holds at least one request, not {batch}")
        lo, hi = self._bracket(context_tokens)
        itls = []
        for context in (lo, hi):
            points = self._at_context(context)
            itls.append(interpolate([p.batch for p in points], [p.itl_s for p in points], batch))
        return interpolate([lo, hi], itls, context_tokens) if hi != lo else itls[0]

    def largest_measured_batch(self, context_tokens: float) -> int:
        """The largest batch measured at both contexts around `context_tokens`: beyond it the profile knows
        nothing."""
        lo, hi = self._bracket(context_tokens)
        return min(max(p.batch for p in self._at_context(c)) for c in (lo, hi))

    def memory_batch(self, kv_tokens_per_request: float) -> int | None:
        """How many requests of this many KV tokens (prompt and answer) a decode's pool holds; None: unknown."""
        if self.decode_kv_tokens is None:
            return None
        return int(self.decode_kv_tokens // max(1.0, kv_tokens_per_request))

    def max_decode_batch(self, itl_bound_s: float, context_tokens: float,
                         kv_tokens_per_request: float | None = None) -> int:
        """The largest batch b whose step, and every smaller batch's, takes at most `itl_bound_s` at this context
        (a batch grows through the smaller ones; a noisy dip past a miss is not counted on), within the measured
        batches and the decode's KV pool (each request holding `kv_tokens_per_request`, by default the context).
        0: even one request alone misses the bound."""
        limit = self.largest_measured_batch(context_tokens)
        memory = self.memory_batch(kv_tokens_per_request or context_tokens)
        if memory is not None:
            limit = min(limit, memory)
        best = 0
        for batch in range(1, limit + 1):
            if self.decode_itl(batch, context_tokens) > itl_bound_s:
                break
            best = batch
        return best

    def decode_tokens_per_s(self, batch: float, context_tokens: float) -> float:
        """Answer tokens per second out of one decode running this batch."""
        return batch / self.decode_itl(batch, context_tokens)
