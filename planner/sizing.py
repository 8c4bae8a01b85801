"""The planner's sizing core: pure, no I/O. Each interval, from the last intervals' observations, it predicts the next
interval's load (planner/predict.py), sizes prefill and decode from the capacity profile (pdcluster/common/capacity.py)
with a correction from the observed SLO attainment, and decides the split of a fixed fleet, with hysteresis and a
minimum dwell time before a reversal, never below one worker per role. Every decision carries its inputs and a reason.

Sizing, per role, in workers:
- prefill: requests queue FCFS for prefills, each served alone in its measured time s (profile at the predicted prompt
  length); the need is the fewest prefills whose M/M/c wait, P(wait > TTFT bound - s), stays under the SLO's miss
  share (Erlang C; the router's least-queued-work pick is close to one shared queue). Deterministic service waits
  less than M/M/c says: the error is on the safe side.
- decode: the largest batch b* whose step meets the ITL bound at the predicted context (and fits the KV pool); a
  request holds a slot for answer x ITL(b*); the need is those slot-seconds per second over b* x decode_utilization.
The split minimises the tighter role's utilization (need / workers). A change is made only when it lowers that
utilization by at least `hysteresis` of itself (a share: the same caution at 4 workers and at 128, light or
overloaded), and a reversal (back toward the role the last change took workers from) only past the dwell time,
unless the current split would overload its tighter role by more than the hysteresis and the new one would not:
following a ramp step by step is not churn, going back and forth is, and sitting out a dwell overloaded when a split
that fits exists is worse than either. The correction reads the attainment of the last
`correction_window` intervals together (a systematic error of the profile, not a burst's queue), once enough requests
were judged, and only when no change happened within the last `window` intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdcluster.common.capacity import Profile
from planner.config import PlannerConfig, Slo
from planner.predict import Load, predict_load


@dataclass(frozen=True)
class Observation:
    """One interval as the router saw it: its load, and of the requests it could judge against each SLO's bound (a
    first token, or still none past the TTFT bound; a finished answer for ITL) how many met it."""

    load: Load
    ttft_met: int = 0
    ttft_judged: int = 0
    itl_met: int = 0
    itl_judged: int = 0

    @property
    def ttft_attainment(self) -> float | None:
        return self.ttft_met / self.ttft_judged if self.ttft_judged else None

    @property
    def itl_attainment(self) -> float | None:
        return self.itl_met / self.itl_judged if self.itl_judged else None


def pooled_attainment(history: Sequence[Observation], window: int, slo: str, least: int) -> tuple[float, int] | None:
    """(share meeting `slo`, requests judged) over the last `window` intervals together, for `slo` "ttft" or "itl";
    None below `least` requests judged (a share of a handful is noise, and the correction would chase it)."""
    recent = history[-window:]
    met = sum(getattr(o, f"{slo}_met") for o in recent)
    judged = sum(getattr(o, f"{slo}_judged") for o in recent)
    return (met / judged, judged) if judged >= least else None


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class PlannerState:
    """What the planner carries from one interval to the next."""

    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    last_change_at: float | None = None
    last_direction: int = 0  # +1: the last change added prefills, -1: decodes


@dataclass(frozen=True)
class Decision:
    """One interval's decision with everything it was made from."""

    at: float
    current: Split
    desired: Split
    predicted: Load
    observed: Observation | None
    prefill_need: float  # workers, corrected
    decode_need: float
    corrections: tuple[float, float]  # (prefill, decode)
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current

    def log_line(self, reason: str | None = None) -> str:
        """The decision as one log line: the inputs, then the verdict (`reason`: the decision's, with more said)."""
        load = self.predicted
        seen = self.observed
        attained = ("" if seen is None else
                    f" attained ttft={_share(seen.ttft_attainment)} itl={_share(seen.itl_attainment)}")
        return (f"planner at={self.at:.0f}s split={self.current} desired={self.desired} "
                f"predicted rps={load.requests_per_s:.3f} prompt={load.prompt_tokens:.0f} "
                f"answer={load.answer_tokens:.0f}{attained} need={self.prefill_need:.2f}P/{self.decode_need:.2f}D "
                f"corrections={self.corrections[0]:.2f}/{self.corrections[1]:.2f} reason={reason or self.reason!r}")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits, for `servers` servers and `offered` Erlangs (1 when offered >=
    servers: the queue grows without bound)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0  # Erlang B by its recurrence, stable for large pools
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return servers * blocking / (servers - offered * (1 - blocking))


def prefill_need(profile: Profile, load: Load, ttft: Slo, cap: int) -> float:
    """The fewest prefills (up to `cap`, then the offered load's share of it) whose wait meets the TTFT SLO."""
    if load.requests_per_s <= 0 or load.prompt_tokens <= 0:
        return 0.0
    service = profile.prefill_seconds(load.prompt_tokens)
    offered = load.requests_per_s * service
    budget = ttft.bound_s - service
    miss_allowed = 1 - ttft.attainment_target
    if budget <= 0:  # even alone the prompt misses the bound: size for throughput with the same margin as a pool
        return offered / 0.5
    for servers in range(max(1, math.floor(offered) + 1), cap + 1):
        wait_tail = erlang_c(servers, offered) * math.exp(-(servers - offered) * budget / service)
        if wait_tail <= miss_allowed:
            return float(servers)
    return max(float(cap), offered / 0.9)  # past the fleet: as much as it would take


def decode_need(profile: Profile, load: Load, itl: Slo, utilization: float) -> float:
    """Decodes whose ITL-bounded batch slots hold the predicted concurrent answers at `utilization`."""
    if load.requests_per_s <= 0 or load.answer_tokens <= 0:
        return 0.0
    context = load.prompt_tokens + load.answer_tokens / 2
    batch = profile.max_decode_batch(itl.bound_s, context, load.prompt_tokens + load.answer_tokens)
    batch = max(1, batch)  # 0: the bound cannot be met at all; one request per decode is the least bad
    concurrent = load.requests_per_s * load.answer_tokens * profile.decode_itl(batch, context)
    return concurrent / (batch * utilization)


def corrected(correction: float, seen: tuple[float, int] | None, slo: Slo, config: PlannerConfig) -> float:
    """A role's correction after an interval, from `seen` = (attainment, requests judged): up by gain x the shortfall
    beyond chance, back toward 1 when the target is met, unchanged in between or with nothing judged. Chance: two
    standard errors of a share at the target over that many requests (at p90 and 100 requests, 0.06); a miss that
    small is the arrivals' luck, not the profile's error."""
    if seen is None:
        return correction
    attainment, judged = seen
    target = slo.attainment_target
    chance = 2 * math.sqrt(target * (1 - target) / judged)
    shortfall = target - attainment
    if shortfall > chance:
        return min(config.max_correction, correction * (1 + config.correction_gain * (shortfall - chance)))
    if shortfall > 0:
        return correction
    return 1 + (correction - 1) * config.correction_decay


def best_split(workers: int, need_p: float, need_d: float, current: Split) -> Split:
    """The split of `workers` (at least one each) that minimises the tighter role's utilization; on a tie, the one
    nearest the current split."""
    if workers < 2:
        raise ValueError(f"a PD fleet needs at least one prefill and one decode, not {workers} workers")
    if need_p <= 0 and need_d <= 0:
        return current
    return min((Split(p, workers - p) for p in range(1, workers)),
               key=lambda s: (utilization(s, need_p, need_d), abs(s.prefill - current.prefill)))


POOL_CAP = 4096  # the most prefills pool_size() considers


def pool_size(config: PlannerConfig, profile: Profile, decision: Decision) -> Split:
    """Workers per role the decision's predicted load needs at the SLOs, with its corrections, whatever the fleet
    has now (a decision's prefill need stops counting at the fleet's size; this one does not), at least one each:
    what a pool scaled by Kubernetes should be."""
    need_p = prefill_need(profile, decision.predicted, config.ttft, POOL_CAP) * decision.corrections[0]
    return Split(max(1, math.ceil(need_p - 1e-9)), max(1, math.ceil(decision.decode_need - 1e-9)))


def utilization(split: Split, need_p: float, need_d: float) -> float:
    """The tighter role's need over its workers (above 1: that role cannot meet its SLO)."""
    return max(need_p / split.prefill, need_d / split.decode)


def decide(config: PlannerConfig, profile: Profile, current: Split, state: PlannerState,
           history: Sequence[Observation], now: float) -> tuple[Decision, PlannerState]:
    """This interval's decision and the state to carry to the next; `history` oldest first, its last entry the
    interval just ended."""
    last = history[-1] if history else None
    since = None if state.last_change_at is None else now - state.last_change_at
    # Misses while a change settles (drains, flips, the backlog they leave) are the change's, not the profile's:
    # the correction learns only from intervals the current split served whole.
    settled = since is None or since >= config.window * config.interval_s
    pooled = [pooled_attainment(history, config.correction_window, slo, config.min_judged) if settled else None
              for slo in ("ttft", "itl")]
    corrections = (corrected(state.prefill_correction, pooled[0], config.ttft, config),
                   corrected(state.decode_correction, pooled[1], config.itl, config))
    predicted = predict_load([o.load for o in history], config.predictor, config.window)
    need_p = prefill_need(profile, predicted, config.ttft, current.workers) * corrections[0]
    need_d = decode_need(profile, predicted, config.itl, config.decode_utilization) * corrections[1]
    desired = best_split(current.workers, need_p, need_d, current)
    now_u, then_u = utilization(current, need_p, need_d), utilization(desired, need_p, need_d)
    direction = (desired.prefill > current.prefill) - (desired.prefill < current.prefill)
    if desired == current:
        reason = f"hold: {current} is the best split (tighter role at {now_u:.2f})"
    elif (since is not None and since < config.dwell_s and direction != state.last_direction
          and not (now_u > 1 + config.hysteresis and then_u <= 1)):
        reason = (f"hold: dwell, the last change went the other way {since:.0f}s ago (< {config.dwell_s:.0f}s); "
                  f"{desired} would be better")
        desired = current
    elif now_u - then_u < config.hysteresis * now_u:
        reason = (f"hold: {desired} would take the tighter role from {now_u:.2f} to {then_u:.2f}, less than the "
                  f"hysteresis ({config.hysteresis:.2f} of it)")
        desired = current
    else:
        role = "prefill" if desired.prefill > current.prefill else "decode"
        reason = (f"change to {desired}: {abs(desired.prefill - current.prefill)} to {role}, the tighter role from "
                  f"{now_u:.2f} to {then_u:.2f}")
        if since is not None and since < config.dwell_s and direction != state.last_direction:
            reason += f" (a reversal within the dwell: {current} would overload its tighter role, {desired} not)"
    decision = Decision(now, current, desired, predicted, last, need_p, need_d, corrections, reason)
    new_state = replace(state, prefill_correction=corrections[0], decode_correction=corrections[1])
    if decision.changes:
        new_state = replace(new_state, last_change_at=now, last_direction=direction)
    return decision, new_state
