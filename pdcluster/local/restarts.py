"""When to restart a component that exited without being asked to: exponential backoff and crash-loop detection.

Policy only, no processes and no sleeping: the local cluster (pdcluster/local/cluster.py) tells a `Backoff` when its
component starts and exits, and the answer says how long to wait before starting it again. The clock is injected,
so the whole policy is tested with a fake one (tests/unit/test_restarts.py).

- The first restart waits `initial` seconds, each further one twice as long, up to `cap`.
- A run that lasted `stable_after` seconds or more resets the wait to `initial`: one crash a day restarts at once.
- `loop_exits` exits within `loop_window` seconds is a crash loop: reported loudly, and every restart then waits
  `cap`, until the component has stayed up `stable_after` seconds again. It never spins.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    initial: float = 1.0
    cap: float = 30.0
    loop_exits: int = 5
    loop_window: float = 120.0
    stable_after: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.cap:
            raise ValueError("restart backoff needs 0 < initial <= cap")
        if self.loop_exits < 2 or self.loop_window <= 0 or self.stable_after <= 0:
            raise ValueError("crash loop needs loop_exits >= 2, loop_window > 0 and stable_after > 0")


@dataclass(frozen=True)
class Decision:
    """What to do about one exit."""

    delay: float  # seconds to wait before starting the component again
    restart: int  # the number of the restart this leads to (1 for the first)
    ran: float  # how long the run that just ended lasted, in seconds
    crash_loop: bool  # loop_exits exits within loop_window: restarts are held at the cap
    loop_started: bool  # this exit is the one that made it a crash loop (report it once, loudly)
    exits_in_window: int


@dataclass
class Backoff:
    """The restart state of one component."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    restarts: int = 0
    started_at: float | None = None
    _next_delay: float | None = None
    _exits: deque = field(default_factory=deque)
    _in_loop: bool = False

    def started(self) -> None:
        self.started_at = self.clock()

    def exited(self) -> Decision:
        now = self.clock()
        policy = self.policy
        ran = now - self.started_at if self.started_at is not None else 0.0
        self.started_at = None
        if ran >= policy.stable_after:  # it had settled: this exit is news, not part of a pattern
            self._next_delay, self._in_loop = None, False
            self._exits.clear()
        self._exits.append(now)
        while self._exits and now - self._exits[0] > policy.loop_window:
            self._exits.popleft()
        crash_loop = len(self._exits) >= policy.loop_exits or self._in_loop
        loop_started = crash_loop and not self._in_loop
        self._in_loop = crash_loop
        delay = policy.initial if self._next_delay is None else self._next_delay
        if crash_loop:
            delay = policy.cap
        self._next_delay = min(policy.cap, delay * 2)
        self.restarts += 1
        return Decision(delay, self.restarts, ran, crash_loop, loop_started, len(self._exits))
