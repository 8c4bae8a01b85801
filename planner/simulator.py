"""The planner's simulator: a fleet of N workers with roles, driven by the capacity profile, replaying a trace under a
policy that may change the split (planner/sim_policies.py: every static split, the planner, the oracle). The gym
(`make bench-planner`, bench/planner/) scores policies on it; a test checks it against a case worked out by hand.

A request arrives, goes to the active prefill with the least booked work (the router's pick), waits FCFS there,
is prefilled in its measured time, then waits in one FIFO for an active decode with room (the fewest running among
them); its first token reaches the client when a decode admits it (TTFT), and its mean ITL is the time from there
to its last token over the tokens after the first. It is SLO-good when both meet their bounds. A policy's change of
split drains the workers it moves (no new work; the least loaded chosen, never the last active one of a role), then
each flips in the profile's measured flip time, or DEFAULT_FLIP_SECONDS when the profile has none (a stated default,
not a measurement), and serves in its new role. The score: SLO-good requests per worker per second of the trace.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.common.capacity import Profile
from planner.predict import Load
from planner.sim_workers import DecodeBatch, Model, PrefillQueue, Request, Worker
from planner.sizing import Observation, Split

# The target for a flip on this CPU (end of drain to serving in the new role), used while no flip has been
# measured: SGLang's own switch took 0.24-0.51 s on an idle SmolLM2 worker, re-registration and the admission canary
# come on top. A default, not a measurement.
DEFAULT_FLIP_SECONDS = 15.0
DRAIN_AFTER_TRACE_S = 900.0  # after the last arrival, how long in-flight requests get to finish

_PREFILL_DONE, _DECODE_DUE, _FLIP_DONE, _TICK = range(4)


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Trace:
    """Requests as (arrival s, prompt tokens, answer tokens), arrivals ascending, and the trace's named phases."""

    name: str
    requests: tuple[tuple[float, int, int], ...]
    duration: float
    phases: tuple[Phase, ...]


class Policy:
    """A split at the start and, every `interval` seconds (None: never), maybe another."""

    name = "policy"
    interval: float | None = None

    def initial(self, workers: int) -> Split:
        raise NotImplementedError

    def tick(self, now: float, observation: Observation) -> Split | None:
        return None


@dataclass
class RunResult:
    policy: str
    workers: int
    requests: list[Request]
    good: list[bool]
    goodput: float  # SLO-good requests per worker per second of the trace
    phase_goodput: dict[str, float]
    changes: int  # times the split changed
    flips: int  # workers flipped
    splits: list[tuple[float, str]] = field(default_factory=list)  # (time, split) at each change


@dataclass
class _Interval:
    """What the router would have counted since the policy's last tick."""

    arrivals: int = 0
    prompt_tokens: int = 0
    first_tokens: int = 0
    ttft_met: int = 0
    finished: int = 0
    itl_met: int = 0
    answer_tokens: int = 0


class Simulator:
    def __init__(self, profile: Profile, workers: int, ttft_bound: float, itl_bound: float,
                 flip_seconds: float | None = None):
        if workers < 2:
            raise ValueError(f"a PD fleet needs at least 2 workers, not {workers}")
        self.model = Model(profile)
        self.n, self.ttft_bound, self.itl_bound = workers, ttft_bound, itl_bound
        self.flip_seconds = flip_seconds or profile.flip_seconds or DEFAULT_FLIP_SECONDS

    def run(self, trace: Trace, policy: Policy) -> RunResult:
        self._reset(policy.initial(self.n))
        requests = [Request(a, p, d) for a, p, d in trace.requests]
        ticks = policy.interval
        if ticks:
            self._push(ticks, _TICK)
        for request in requests:
            self._until(request.arrival, policy, trace.duration)
            self._arrive(request)
        self._until(trace.duration + DRAIN_AFTER_TRACE_S, policy, trace.duration)
        return self._score(trace, policy, requests)

    # ----- the event loop -----

    def _reset(self, split: Split) -> None:
        self.workers = [Worker(i, "prefill" if i < split.prefill else "decode", PrefillQueue(), DecodeBatch(self.model))
                        for i in range(self.n)]
        # (time, sequence: FIFO among equal times, kind, the worker concerned, the decode's version when scheduled)
        self.events: list[tuple[float, int, int, Worker | None, int]] = []
        self.seq = itertools.count()
        self.waiting: deque[Request] = deque()  # prefilled, waiting for a decode
        self.unanswered: deque[Request] = deque()  # arrived, no first token yet (in arrival order; lazily cleaned)
        self.interval = _Interval()
        self.changes = self.flips = 0
        self.splits = [(0.0, str(split))]
        self.last_answer = 0.0

    def _push(self, at: float, kind: int, worker: Worker | None = None, version: int = 0) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, worker, version))

    def _until(self, t: float, policy: Policy, duration: float) -> None:
        """Every event up to time `t`, in time order."""
        while self.events and self.events[0][0] <= t:
            now, _, kind, worker, version = heapq.heappop(self.events)
            if worker is not None and kind == _PREFILL_DONE:
                self._prefilled(worker, now)
            elif worker is not None and kind == _DECODE_DUE:
                if version == worker.decode.version:  # else stale: the batch changed since it was scheduled
                    self._decoded(worker, now)
            elif worker is not None and kind == _FLIP_DONE:
                self._flipped(worker, now)
            elif now <= duration:  # a policy tick: none after the trace
                desired = policy.tick(now, self._observe(now, policy.interval or 1.0))
                if desired is not None:
                    self.apply(desired, now)
                self._push(now + (policy.interval or 1.0), _TICK)

    def _active(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.state == "active"]

    def _arrive(self, request: Request) -> None:
        worker = min(self._active("prefill"), key=lambda w: w.prefill.queued_tokens)
        self.interval.arrivals += 1
        self.interval.prompt_tokens += request.prompt_tokens
        self.unanswered.append(request)
        side = worker.prefill
        side.queue.append(request)
        side.queued_tokens += request.prompt_tokens
        if len(side.queue) == 1:
            self._push(request.arrival + self.model.prefill_seconds(request.prompt_tokens), _PREFILL_DONE, worker)

    def _prefilled(self, worker: Worker, now: float) -> None:
        side = worker.prefill
        request = side.queue.popleft()
        side.queued_tokens -= request.prompt_tokens
        if side.queue:
            self._push(now + self.model.prefill_seconds(side.queue[0].prompt_tokens), _PREFILL_DONE, worker)
        elif worker.state == "draining":
            self._start_flip(worker, now)
        self.waiting.append(request)
        self._admit(now)

    def _admit(self, now: float) -> None:
        decodes = self._active("decode") if self.waiting else []
        while self.waiting and decodes:
            request = self.waiting[0]
            worker = min(decodes, key=lambda w: w.decode.size)
            if not worker.decode.has_room(request):
                roomy = [w for w in decodes if w.decode.has_room(request)]
                if not roomy:
                    return
                worker = min(roomy, key=lambda w: w.decode.size)
            self.waiting.popleft()
            request.first_token = now
            self.interval.first_tokens += 1
            self.interval.ttft_met += now - request.arrival <= self.ttft_bound
            worker.decode.admit(request, now)
            self._schedule(worker)

    def _schedule(self, worker: Worker) -> None:
        due = worker.decode.next_finish()
        if due is not None:
            self._push(due, _DECODE_DUE, worker, worker.decode.version)

    def _decoded(self, worker: Worker, now: float) -> None:
        for request in worker.decode.finish_due(now):
            request.done = now
            self.interval.finished += 1
            self.interval.answer_tokens += request.answer_tokens
            self.interval.itl_met += (request.mean_itl or 0.0) <= self.itl_bound
        self._schedule(worker)
        if worker.state == "draining" and worker.decode.size == 0:
            self._start_flip(worker, now)
        self._admit(now)

    # ----- changes of split -----

    def apply(self, desired: Split, now: float) -> None:
        """Move workers toward `desired`: counting draining and flipping ones as their new role already."""
        headed_prefill = sum(1 for w in self.workers
                             if (w.role == "prefill" and w.state == "active") or w.target == "prefill")
        moving = desired.prefill - headed_prefill
        source, target = ("decode", "prefill") if moving > 0 else ("prefill", "decode")
        candidates = sorted(self._active(source), key=Worker.load)
        chosen = candidates[:min(abs(moving), len(candidates) - 1)]
        if not chosen:
            return
        self.changes += 1
        self.flips += len(chosen)
        self.splits.append((now, str(desired)))
        for worker in chosen:
            worker.state, worker.target = "draining", target
            if worker.empty:
                self._start_flip(worker, now)

    def _start_flip(self, worker: Worker, now: float) -> None:
        worker.state = "flipping"
        self._push(now + self.flip_seconds, _FLIP_DONE, worker)

    def _flipped(self, worker: Worker, now: float) -> None:
        worker.role, worker.state, worker.target = worker.target, "active", ""
        worker.decode.updated = now
        if worker.role == "decode":
            self._admit(now)

    # ----- what a policy sees, and the score -----

    def _observe(self, now: float, interval: float) -> Observation:
        seen, self.interval = self.interval, _Interval()
        while self.unanswered and self.unanswered[0].first_token is not None:
            self.unanswered.popleft()
        late = 0
        for request in self.unanswered:  # still waiting past the TTFT bound: misses the router can already count
            if request.arrival > now - self.ttft_bound:
                break
            late += request.first_token is None
        if seen.finished:
            self.last_answer = seen.answer_tokens / seen.finished
        prompt = seen.prompt_tokens / seen.arrivals if seen.arrivals else 0.0
        return Observation(Load(seen.arrivals / interval, prompt, self.last_answer), ttft_met=seen.ttft_met,
                           ttft_judged=seen.first_tokens + late, itl_met=seen.itl_met, itl_judged=seen.finished)

    def is_good(self, request: Request) -> bool:
        ttft, itl = request.ttft, request.mean_itl
        return ttft is not None and itl is not None and ttft <= self.ttft_bound and itl <= self.itl_bound

    def _score(self, trace: Trace, policy: Policy, requests: Sequence[Request]) -> RunResult:
        good = [self.is_good(r) for r in requests]
        phases = {}
        for phase in trace.phases:
            count = sum(g for r, g in zip(requests, good, strict=True) if phase.start <= r.arrival < phase.end)
            phases[phase.name] = count / (self.n * (phase.end - phase.start))
        return RunResult(policy.name, self.n, list(requests), good, sum(good) / (self.n * trace.duration), phases,
                         self.changes, self.flips, self.splits)
