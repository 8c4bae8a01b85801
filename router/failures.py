"""What a failed half means: the status the client gets, and whether a new pair may be tried.

Retryable (before the client got a byte): the worker could not be reached, dropped the connection, or answered
5xx/429. Not retryable: a timeout (the work may be running still) and a worker's own 4xx (the request's fault).

What a client reads names the role and the worker's id, never a URL or an operating system's error text: those
stay in `detail`, which goes to the router's log with the request id.
"""

from __future__ import annotations

from pdcluster.http import error_body
from router.edge import Answer, json_answer
from router.upstream import ConnectFailed, UpstreamError
from router.workers import Worker


class HalfFailed(Exception):
    """One half of the pair failed before the client got anything. `retryable`: a new pair may succeed."""

    def __init__(self, worker: Worker, status: int, message: str, body: bytes | None = None,
                 retryable: bool = False, transport: bool = False, detail: str = ""):
        super().__init__(message)
        self.worker, self.status, self.message, self.body, self.retryable = worker, status, message, body, retryable
        self.transport = transport  # the worker could not be reached or dropped the connection
        self.detail = detail  # for the log only

    @property
    def counts_against_worker(self) -> bool:
        """A failure of the worker itself (not of the request): its breaker hears of it."""
        return self.status >= 500 or self.status == 429

    def answer(self) -> Answer:
        if self.body is not None and 400 <= self.status < 500:
            # A worker's own 4xx (e.g. prompt longer than the context) is the client's problem: pass it on as is.
            return Answer(self.status, self.body)
        return json_answer(self.status, error_body(self.status, self.message))


class DeadlinePassed(HalfFailed):
    """A limit of the router's own (total_timeout, first_token_timeout) ran out: both halves are aborted."""


# What a refused, broken or stalled connection raises (a stall: ReadTimeout, which is also a TimeoutError).
TRANSPORT_ERRORS = (UpstreamError, TimeoutError)


def _who(worker: Worker) -> str:
    return f"{worker.role.value} {worker.worker_id}"


def transport_failure(worker: Worker, exc: Exception) -> HalfFailed:
    detail = f"{worker.url}: {type(exc).__name__}: {exc}"
    if isinstance(exc, ConnectFailed):  # the worker never saw the request: another pair may take it
        return HalfFailed(worker, 502, f"{_who(worker)} unreachable", retryable=True, transport=True, detail=detail)
    if isinstance(exc, TimeoutError):
        return HalfFailed(worker, 504, f"{_who(worker)} timed out", transport=True, detail=detail)
    return HalfFailed(worker, 502, f"{_who(worker)} dropped the connection", retryable=True, transport=True,
                      detail=detail)


def status_failure(worker: Worker, status: int, payload: bytes) -> HalfFailed:
    retryable = status >= 500 or status == 429
    return HalfFailed(worker, status if status < 500 else 502, f"{_who(worker)} answered {status}",
                      payload, retryable, detail=f"{worker.url}: {payload[:200]!r}")
