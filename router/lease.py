"""The workers' books for one attempt, kept in one place: a Lease on the pair, held for the length of the attempt.

- `in_flight` (what load-aware policies compare): +1 on both workers from the attempt's start until its answer is
  over: for a stream, its last chunk, so the relay that the lease is handed over to releases it (or the stream's
  close hook, if the client left before the relay began).
- The circuit breaker (router/breaker.py): the attempt may be a half-open breaker's trial. When the decode's
  answer starts, the trial succeeded; when a half fails, that worker's breaker hears of it if the failure is the
  worker's (failures.py); either way the trial is over when the `with` block ends, also for an attempt that
  proved nothing (a 4xx, a client that left, the other half's failure).
- Ejection: a half that could not be reached or dropped the connection is out of rotation until one of its
  health probes succeeds (router/health.py readmits it).

A failure after the answer started (mid-stream) is reported with `failed` by the relay that holds the lease.
"""

from __future__ import annotations

from typing import Any

from router.failures import HalfFailed
from router.health import mark_failed
from router.workers import Worker


class Lease:
    __slots__ = ("prefill", "decode", "_ejections", "_held", "handed_over")

    def __init__(self, prefill: Worker, decode: Worker, ejections: Any):
        self.prefill, self.decode, self._ejections = prefill, decode, ejections  # ejections: metrics, by role
        self._held = self.handed_over = False

    def __enter__(self) -> Lease:
        for worker in (self.prefill, self.decode):
            worker.in_flight += 1
            worker.breaker.on_attempt()
        self._held = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: Any) -> None:
        if exc is None:  # the answer started: both workers did their part
            self.prefill.breaker.on_success()
            self.decode.breaker.on_success()
        elif isinstance(exc, HalfFailed):
            self.failed(exc)
        for worker in (self.prefill, self.decode):
            worker.breaker.on_end()
        if not self.handed_over:
            self.release()

    def hand_over(self) -> Lease:
        """The answer is a stream: its relay releases the lease when the stream ends (`release`)."""
        self.handed_over = True
        return self

    def failed(self, failure: HalfFailed) -> None:
        worker = failure.worker
        if failure.counts_against_worker:
            worker.breaker.on_failure()
        if failure.transport:  # unreachable or dropped the connection: out of rotation until a probe succeeds
            mark_failed(worker, threshold=1)
            self._ejections.labels(worker.role.value).inc()

    @property
    def held(self) -> bool:
        """Not yet released: the attempt is not over."""
        return self._held

    def release(self) -> None:
        if self._held:
            self._held = False
            self.prefill.in_flight -= 1
            self.decode.in_flight -= 1
