"""A per-worker circuit breaker: after `threshold` consecutive failures a worker gets no traffic for `cooldown`
seconds, then one trial request (half-open); its success closes the breaker, its failure opens it again.

Every attempt ends in `on_end`, whatever became of it (a 4xx, a client that left, a timeout, the other half's
failure): a trial that proved nothing frees the slot for the next one instead of keeping the worker out for good.
A successful health probe after the cooldown counts as a successful trial.
"""

from __future__ import annotations

import time
from enum import IntEnum


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, threshold: int = 5, cooldown: float = 10.0, clock=time.monotonic):
        self.threshold, self.cooldown, self._clock = threshold, cooldown, clock
        self.failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.cooldown:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def on_attempt(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def on_success(self) -> None:
        self.failures, self._opened_at, self._trial_in_flight = 0, None, False

    def on_failure(self) -> None:
        self.failures += 1
        self._trial_in_flight = False
        if self.failures >= self.threshold or self._opened_at is not None:
            self._opened_at = self._clock()

    def on_end(self) -> None:
        """The attempt is over; if it settled nothing, the next request may be the trial."""
        self._trial_in_flight = False

    def on_probe_success(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.on_success()
