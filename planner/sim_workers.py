"""The simulator's requests and workers (planner/simulator.py runs them), each driven by the capacity profile
(pdcluster/common/capacity.py):

- a prefill serves its queue first come, first served, one prompt at a time, each in the profile's time for its
  length; its booked work is its queued prompt tokens (what the router books and picks the least of);
- a decode runs every request it holds in one batch: each step takes the profile's ITL at the batch's size and mean
  context, and every running request gains a token per step. It admits a request while its KV pool holds the
  request's prompt and answer and while the batch stays within the batches the profile measured (beyond them the
  profile knows nothing, so the simulator does not go there).

A decode's progress is kept as one counter of steps taken, so that between two events (an admission, a completion)
nothing is computed per token: a request finishes when the counter reaches its mark. The step time is re-read from
the profile at each event, with the batch's mean context then.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from pdcluster.common.capacity import Profile


@dataclass(slots=True, eq=False)
class Request:
    """One request of a trace and, once simulated, when its first token came and when it ended."""

    arrival: float
    prompt_tokens: int
    answer_tokens: int  # the first comes from the prefill, the rest from decode steps
    first_token: float | None = None
    done: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def mean_itl(self) -> float | None:
        """The request's mean gap between tokens after the first (0 for a one-token answer)."""
        if self.done is None or self.first_token is None:
            return None
        return (self.done - self.first_token) / max(1, self.answer_tokens - 1)


class Model:
    """The profile's answers the simulator asks millions of times, memoised on the questions it asks."""

    CONTEXT_STEP = 32  # contexts are rounded to this for the ITL and batch-limit memos

    def __init__(self, profile: Profile):
        self.profile = profile
        self.kv_tokens = profile.decode_kv_tokens
        self._prefill: dict[int, float] = {}
        self._itl: dict[tuple[int, int], float] = {}
        self._batch: dict[int, int] = {}

    def prefill_seconds(self, prompt_tokens: int) -> float:
        seconds = self._prefill.get(prompt_tokens)
        if seconds is None:
            seconds = self._prefill[prompt_tokens] = self.profile.prefill_seconds(prompt_tokens)
        return seconds

    def itl(self, batch: int, context: float) -> float:
        key = (batch, int(context) // self.CONTEXT_STEP)
        seconds = self._itl.get(key)
        if seconds is None:
            seconds = self._itl[key] = self.profile.decode_itl(batch, key[1] * self.CONTEXT_STEP)
        return seconds

    def batch_limit(self, context: float) -> int:
        key = int(context) // self.CONTEXT_STEP
        limit = self._batch.get(key)
        if limit is None:
            limit = self._batch[key] = self.profile.largest_measured_batch(key * self.CONTEXT_STEP)
        return limit


@dataclass(eq=False)
class PrefillQueue:
    """A worker's prefill side: FCFS, one prompt at a time."""

    queue: deque[Request] = field(default_factory=deque)
    queued_tokens: int = 0  # the running prompt's and the waiting ones'

    @property
    def idle(self) -> bool:
        return not self.queue


@dataclass(eq=False)
class DecodeBatch:
    """A worker's decode side: one batch, its progress as a count of steps (`steps`) since the worker started."""

    model: Model
    steps: float = 0.0
    updated: float = 0.0  # when `steps` was last brought up to date
    itl: float = 0.0  # the current step time (0: empty)
    running: list[tuple[float, int, Request]] = field(default_factory=list)  # heap of (finish mark, seq, request)
    kv_used: int = 0
    prompt_sum: int = 0  # of the running requests, for the batch's mean context
    joined_sum: float = 0.0  # their `steps` at admission
    version: int = 0  # bumped at every change: a completion event of an older version is stale
    seq: int = 0

    @property
    def size(self) -> int:
        return len(self.running)

    def advance(self, now: float) -> None:
        if self.itl > 0:
            self.steps += (now - self.updated) / self.itl
        self.updated = now

    def mean_context(self, extra_prompt: int = 0, extra: int = 0) -> float:
        n = self.size + extra
        if n == 0:
            return 0.0
        generated = self.size * self.steps - self.joined_sum
        return (self.prompt_sum + extra_prompt + generated) / n

    def has_room(self, request: Request) -> bool:
        need = request.prompt_tokens + request.answer_tokens
        if self.model.kv_tokens is not None and self.kv_used + need > self.model.kv_tokens:
            return self.size == 0  # a request alone always runs: the router refuses one that cannot fit at all
        return self.size + 1 <= self.model.batch_limit(self.mean_context(request.prompt_tokens, 1))

    def admit(self, request: Request, now: float) -> None:
        self.advance(now)
        self.seq += 1
        heapq.heappush(self.running, (self.steps + request.answer_tokens - 1, self.seq, request))
        self.kv_used += request.prompt_tokens + request.answer_tokens
        self.prompt_sum += request.prompt_tokens
        self.joined_sum += self.steps
        self._retime()

    def finish_due(self, now: float) -> list[Request]:
        """Advance to `now` and take out every request whose mark is reached."""
        self.advance(now)
        done = []
        while self.running and self.running[0][0] <= self.steps + 1e-6:
            mark, _, request = heapq.heappop(self.running)
            self.kv_used -= request.prompt_tokens + request.answer_tokens
            self.prompt_sum -= request.prompt_tokens
            self.joined_sum -= mark - (request.answer_tokens - 1)
            done.append(request)
        self._retime()
        return done

    def _retime(self) -> None:
        self.version += 1
        self.itl = self.model.itl(self.size, self.mean_context()) if self.running else 0.0
        if not self.running:
            self.steps = self.joined_sum = 0.0  # nothing refers to the old counter: keep the floats small

    def next_finish(self) -> float | None:
        """When the first running request reaches its mark at the current step time (None: empty)."""
        if not self.running:
            return None
        return self.updated + max(0.0, self.running[0][0] - self.steps) * self.itl


@dataclass(eq=False)
class Worker:
    """One worker with its role; `state` is active, draining (no new work, finishing its own) or flipping."""

    id: int
    role: str  # "prefill" | "decode"
    prefill: PrefillQueue
    decode: DecodeBatch
    state: str = "active"
    target: str = ""  # the role a draining or flipping worker becomes

    @property
    def empty(self) -> bool:
        return self.prefill.idle if self.role == "prefill" else self.decode.size == 0

    def load(self) -> float:
        """What flipping it away would cost: a prefill's booked tokens, a decode's running requests."""
        return self.prefill.queued_tokens if self.role == "prefill" else self.decode.size
