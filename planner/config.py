"""The planner's configuration (configs/planner.yaml): the SLOs it sizes for, how often it decides, whether it acts, and
what keeps it from churning. Validated at the edge (pydantic); the sizing core trusts it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdcluster.common.config_file import load_yaml, secret_or_env


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Slo(_Strict):
    """`percentile` percent of requests within `bound_s` (TTFT: arrival to first token; ITL: a request's mean gap
    between tokens)."""

    percentile: float = Field(gt=0, le=100)
    bound_s: float = Field(gt=0)

    @property
    def attainment_target(self) -> float:
        """The share of requests that must meet the bound: 0.9 for a p90 SLO."""
        return self.percentile / 100


class PlannerConfig(_Strict):
    """What the planner sizes for and how cautiously it changes a split."""

    # configs/planner.yaml's, for SmolLM2-135M on this machine's CPU (why: there).
    ttft: Slo = Slo(percentile=90, bound_s=30.0)
    itl: Slo = Slo(percentile=90, bound_s=0.3)
    interval_s: float = Field(default=60.0, gt=0)  # one decision per interval, on the interval's observations
    mode: Literal["recommend", "act"] = "recommend"  # recommend: log and export the decision; act: flip workers too
    # No reversal (back toward the role the last change took workers from) within this long of the last change: a
    # flip costs a drain, a cold cache and the flip itself, and a load that reverses within minutes is noise to
    # ride out, not a mix to follow. Moves in the same direction (a ramp) are not held.
    dwell_s: float = Field(default=600.0, ge=0)
    # A change must lower the tighter role's predicted utilization by at least this share of it (0.2: from 1.0 to
    # 0.8 or lower): a prediction's noise, or one worker's worth of rounding, alone never flips a worker.
    hysteresis: float = Field(default=0.2, ge=0, lt=1)
    predictor: Literal["constant", "moving_average", "linear_trend"] = "moving_average"
    window: int = Field(default=3, ge=1)  # intervals the predictors look back over
    # Share of a decode's ITL-bounded batch slots the sizing fills: the rest absorbs arrivals' randomness.
    decode_utilization: float = Field(default=0.85, gt=0, le=1)
    # The SLO correction: a role whose attainment (over `correction_window` intervals) misses its target is sized up
    # by gain x the shortfall per interval, up to max_correction x; met again, it decays toward 1 by
    # `correction_decay`. Slow on purpose: it is for what the profile gets wrong, not for a burst's queue.
    correction_gain: float = Field(default=1.0, ge=0)
    max_correction: float = Field(default=1.5, ge=1)
    correction_decay: float = Field(default=0.5, ge=0, le=1)
    correction_window: int = Field(default=10, ge=1)  # intervals whose attainment the correction reads together
    min_judged: int = Field(default=20, ge=1)  # requests judged (over those intervals) before correcting
    profile: str = "configs/profiles/smollm2-135m-instruct.json"  # pdcluster/common/capacity.py's Profile, as JSON
    # Where the live planner reads the load (the router's metrics) and the workers (the registry).
    router_url: str = "http://127.0.0.1:8000"
    bootstrap_url: str = "http://127.0.0.1:8998"
    # Its own /metrics (python -m planner): loopback unless said otherwise, like every port but the router's.
    host: str = "127.0.0.1"
    port: int = Field(default=9300, ge=1, le=65535)
    # The bootstrap service's shared secret, sent on a flip (PDCLUSTER_TOKEN when unset); never printed.
    token: str | None = None
    log_level: str = "info"

    def resolved_token(self) -> str | None:
        return secret_or_env(self.token, "PDCLUSTER_TOKEN")

    @classmethod
    def from_file(cls, path: str | Path) -> PlannerConfig:
        """The config in a YAML file; pdcluster.common.config_file.ConfigError or pydantic's ValidationError if bad."""
        return cls.model_validate(load_yaml(path))
