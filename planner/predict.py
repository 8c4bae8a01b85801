"""The next interval's load from the last intervals' (planner/sizing.py sizes for what these predict): request rate,
mean prompt and mean answer tokens, each series predicted on its own.

Three predictors, the simple end of what NVIDIA Dynamo's planner offers (constant, ARIMA, Kalman, Prophet): the last
value; the mean of the last `window`; a least-squares line through the last `window`, one step ahead (it follows a
ramp at once, and overshoots a step by half a window, which the dwell time and hysteresis absorb). Never negative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Predictor = Literal["constant", "moving_average", "linear_trend"]


@dataclass(frozen=True)
class Load:
    """One interval's load: requests per second and the mean prompt and answer lengths of its requests."""

    requests_per_s: float
    prompt_tokens: float
    answer_tokens: float


def predict_series(values: Sequence[float], predictor: Predictor, window: int) -> float:
    """The next value of `values` (oldest first) by `predictor` over the last `window` values; 0 for no history."""
    recent = list(values)[-window:]
    if not recent:
        return 0.0
    if predictor == "constant" or len(recent) == 1:
        return recent[-1]
    if predictor == "moving_average":
        return sum(recent) / len(recent)
    n = len(recent)
    mean_x, mean_y = (n - 1) / 2, sum(recent) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in enumerate(recent))
             / sum((x - mean_x) ** 2 for x in range(n)))
    return max(0.0, mean_y + slope * (n - mean_x))


def predict_load(history: Sequence[Load], predictor: Predictor, window: int) -> Load:
    """The next interval's Load; lengths predicted from the intervals that had requests (an idle interval has no
    mean length, and a zero would drag the mean down)."""
    busy = [h for h in history if h.requests_per_s > 0]
    return Load(requests_per_s=predict_series([h.requests_per_s for h in history], predictor, window),
                prompt_tokens=predict_series([h.prompt_tokens for h in busy], predictor, window),
                answer_tokens=predict_series([h.answer_tokens for h in busy], predictor, window))
