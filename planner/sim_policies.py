"""The policies the simulator (planner/simulator.py) compares: a static split, the planner (the sizing core,
planner/sizing.py, deciding each interval on what the simulated router observed), and an oracle that switches at each
phase's start to that phase's best static split (known from the static runs: no policy can know it live)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.common.capacity import Profile
from planner.config import PlannerConfig
from planner.simulator import Policy
from planner.sizing import Decision, Observation, PlannerState, Split, decide


class Static(Policy):
    def __init__(self, split: Split):
        self.split = split
        self.name = f"static {split}"

    def initial(self, workers: int) -> Split:
        return self.split


class Oracle(Policy):
    """`schedule`: (start time, split) per phase, in time order; checked every `interval` seconds (a change lands at
    the first tick at or after its phase's start)."""

    name = "oracle"

    def __init__(self, schedule: Sequence[tuple[float, Split]], interval: float = 5.0):
        self.schedule, self.interval = list(schedule), interval

    def initial(self, workers: int) -> Split:
        return self.schedule[0][1]

    def tick(self, now: float, observation: Observation) -> Split | None:
        current = [split for start, split in self.schedule if start <= now]
        return current[-1] if current else None


@dataclass
class PlannerPolicy(Policy):
    """The planner in mode act: each interval, decide() on the observations so far, and move to its split."""

    config: PlannerConfig
    profile: Profile
    start: Split
    state: PlannerState = field(default_factory=PlannerState)
    history: list[Observation] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    name: str = "planner"

    def __post_init__(self) -> None:
        self.interval = self.config.interval_s
        self.current = self.start

    def initial(self, workers: int) -> Split:
        return self.start

    def tick(self, now: float, observation: Observation) -> Split | None:
        self.history.append(observation)
        decision, self.state = decide(self.config, self.profile, self.current, self.state, self.history, now)
        self.decisions.append(decision)
        if not decision.changes:
            return None
        self.current = decision.desired
        return decision.desired
