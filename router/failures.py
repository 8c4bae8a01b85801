"""What a failed half means: the status the client gets, whether a new pair may be tried, whether it counts against
the worker, and which halves are aborted.

Retryable (before the client got a byte): the worker could not be reached, dropped the connection, or answered
5xx/429. Not retryable: a timeout (the work may be running still) and a worker's own 4xx (the request's fault).

What a client reads names the role and the worker's id, never a URL or an operating system's error text: those
stay in `detail`, which goes to the router's log with the request id.
"""

from __future__ import annotations

from router.edge import Answer, error_answer
from router.upstream import ConnectFailed, ReadTimeout, UpstreamError
from router.workers import Worker


def worker_fault(status: int) -> bool:
    """A status that is the worker's trouble, not the request's: a new pair may succeed, and its breaker hears of it."""
    return status >= 500 or status == 429


class HalfFailed(Exception):
    """One half of the pair failed before the client got anything. `retryable`: a new pair may succeed.
    `ends_both`: the router gave up on the attempt (a limit of its own): both halves may still be working on it."""

    def __init__(self, worker: Worker, status: int, message: str, body: bytes | None = None,
                 retryable: bool = False, transport: bool = False, detail: str = "", ends_both: bool = False):
        super().__init__(message)
        self.worker, self.status, self.message, self.body, self.retryable = worker, status, message, body, retryable
        self.transport = transport  # the worker could not be reached or dropped the connection
        self.detail = detail  # for the log only
        self.ends_both = ends_both

    @property
    def counts_against_worker(self) -> bool:
        """A failure of the worker itself (not of the request): its breaker hears of it."""
        return worker_fault(self.status)

    def answer(self) -> Answer:
        if self.body and 400 <= self.status < 500:
            # A worker's own 4xx (e.g. prompt longer than the context) is the client's problem: pass it on as is.
            # (Its body can be lost: the other half's failure may interrupt its reading. Then ours says the status.)
            return Answer(self.status, self.body)
        return error_answer(self.status, self.message)


class DeadlinePassed(HalfFailed):
    """A limit of the router's own (total_timeout, first_token_timeout) ran out mid-stream: no fault of the worker's."""

    def __init__(self, worker: Worker, message: str):
        super().__init__(worker, 504, message, ends_both=True)

    @property
    def counts_against_worker(self) -> bool:
        return False


def halves_to_abort(failure: HalfFailed | None, prefill: Worker, decode: Worker) -> tuple[Worker, ...]:
    """Which halves of an attempt that ended early get SGLang's /abort_request: the other half of the one that
    failed (whose own work ended with its error or its connection), or both when the router ended the attempt
    (`failure` None: the client left or total_timeout passed; or a failure that `ends_both`: a deadline of the
    router's own, or a half that timed out)."""
    if failure is None or failure.ends_both:
        return prefill, decode
    return (decode,) if failure.worker is prefill else (prefill,)


# What a refused, broken or stalled connection raises (a stall: ReadTimeout, which is also a TimeoutError).
TRANSPORT_ERRORS = (UpstreamError, TimeoutError)
# What a half of an exchange raises when it fails: its own transport error, or the other half's failure.
HALF_ERRORS = (HalfFailed, *TRANSPORT_ERRORS)


def _who(worker: Worker) -> str:
    return f"{worker.role.value} {worker.worker_id}"


def transport_failure(worker: Worker, exc: Exception) -> HalfFailed:
    detail = f"{worker.url}: {type(exc).__name__}: {exc}"
    if isinstance(exc, ConnectFailed):  # the worker never saw the request: another pair may take it
        return HalfFailed(worker, 502, f"{_who(worker)} unreachable", retryable=True, transport=True, detail=detail)
    if isinstance(exc, TimeoutError):
        # The router gave up waiting, but the worker may still be working on it (a decode still generating): both
        # halves are aborted, as for first_byte_timeout.
        limit = f" for read_timeout ({exc.seconds}s)" if isinstance(exc, ReadTimeout) else ""
        return HalfFailed(worker, 504, f"{_who(worker)} sent nothing{limit}", transport=True, detail=detail,
                          ends_both=True)
    return HalfFailed(worker, 502, f"{_who(worker)} dropped the connection", retryable=True, transport=True,
                      detail=detail)


def as_failure(worker: Worker, exc: Exception) -> HalfFailed:
    """`exc` from one of HALF_ERRORS, raised while waiting on `worker`: the other half's failure as it is, or
    `worker`'s transport failure."""
    return exc if isinstance(exc, HalfFailed) else transport_failure(worker, exc)


# SGLang 0.5.23 answers 500 when a request's grammar admits no token the model can produce (`root ::= root`): the
# request's fault, not the worker's, so it is a 400 that neither retries nor counts against the worker's breaker
# (else five such requests would take a healthy worker out of rotation).
GRAMMAR_FAILED = b"Grammar accept_token failed"


def status_failure(worker: Worker, status: int, payload: bytes) -> HalfFailed:
    if status >= 500 and GRAMMAR_FAILED in payload[:4096]:
        return HalfFailed(worker, 400, "the request's grammar admits no token the model can produce (SGLang: "
                                       "Grammar accept_token failed)", detail=f"{worker.url}: {payload[:200]!r}")
    return HalfFailed(worker, status if status < 500 else 502, f"{_who(worker)} answered {status}",
                      payload, worker_fault(status), detail=f"{worker.url}: {payload[:200]!r}")
