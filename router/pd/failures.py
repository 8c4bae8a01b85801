"""What a failed half means: the status the client gets, whether a new pair may be tried, whether it counts against
the worker, and which halves are aborted.

Retryable (before the client got a byte): the worker could not be reached, dropped the connection, or answered
5xx/429. Not retryable: a timeout (the work may be running still) and a worker's own 4xx (the request's fault).

What a client reads names the role and the worker's id, never a URL or an operating system's error text: those
stay in `detail`, which goes to the router's log with the request id. A worker's own refusal keeps its reason, in
the router's error shape, with what only the server should know taken out (worker_reason).
"""

from __future__ import annotations

import re

import orjson

from pdcluster.common.http import error_body
from pdcluster.common.protocol import Role
from router.fleet.workers import Worker
from router.transport.edge import Answer, error_answer
from router.transport.upstream_response import ConnectFailed, ReadTimeout, UpstreamError


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
        if 400 <= self.status < 500 and (reason := worker_reason(self.body)):
            # A worker's own 4xx (e.g. prompt longer than the context) is the client's problem: its reason, in the
            # router's shape. (Its body can be lost: the other half's failure may interrupt its reading. Then ours
            # says the status.)
            return error_answer(self.status, f"{self.message}: {reason}")
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


def grammar_failure(worker: Worker, payload: bytes) -> HalfFailed:
    return HalfFailed(worker, 400, "the request's grammar admits no token the model can produce (SGLang: "
                                   "Grammar accept_token failed)", detail=f"{worker.url}: {payload[:200]!r}")


def status_failure(worker: Worker, status: int, payload: bytes) -> HalfFailed:
    if status >= 500 and GRAMMAR_FAILED in payload[:4096]:
        return grammar_failure(worker, payload)
    return HalfFailed(worker, status if status < 500 else 502, f"{_who(worker)} answered {status}",
                      payload, worker_fault(status), detail=f"{worker.url}: {payload[:200]!r}")


# What SGLang's decode says when a request's KV did not come within SGLANG_DISAGGREGATION_WAITING_TIMEOUT (0.5.23:
# "Request <room> timed out after <s>s in KVPoll.WaitingForInput", disaggregation/common/conn.py).
KV_WAIT_TIMED_OUT = b"in KVPoll.WaitingForInput"


def kv_wait_timed_out(failure: HalfFailed) -> bool:
    """Whether the failure is a decode's that waited out SGLang's KV timeout."""
    return failure.worker.role is Role.DECODE and KV_WAIT_TIMED_OUT in (failure.body or b"")[:4096]


def prefill_answer(worker: Worker, status: int, payload: bytes) -> bytes:
    """The prefill half's answer, or its HalfFailed raised: an error status, or a 200 that says it aborted."""
    if status >= 400:
        raise status_failure(worker, status, payload)
    if (aborted := prefill_aborted(worker, payload)) is not None:
        raise aborted
    return payload


def prefill_aborted(worker: Worker, payload: bytes) -> HalfFailed | None:
    """A prefill's 200 that says it aborted the request (SGLang answers 200 for an abort that carries no status
    code, e.g. one its scheduler made): no KV is coming, so the decode must not be left waiting for it (it would
    wait out its own bootstrap timeout, minutes). JSON or a stream's events, native or OpenAI."""
    if b"abort" not in payload and b'"error"' not in payload:
        return None  # decided without parsing
    for part in payload.split(b"\n\n") if payload.startswith(b"data:") else [payload]:
        part = part.removeprefix(b"data:").strip()
        try:
            answers = orjson.loads(part)
        except orjson.JSONDecodeError:
            continue
        for answer in answers if isinstance(answers, list) else [answers]:  # a native batch: a list of answers
            if isinstance(answer, dict) and (failure := _aborted(worker, answer, payload)) is not None:
                return failure
    return None


def _aborted(worker: Worker, answer: dict, payload: bytes) -> HalfFailed | None:
    choices = answer.get("choices")
    reasons = [choice.get("finish_reason") for choice in choices if isinstance(choice, dict)] \
        if isinstance(choices, list) else []
    meta = answer.get("meta_info")
    reasons.append(meta.get("finish_reason") if isinstance(meta, dict) else None)
    for reason in reasons:
        if reason == "abort" or (isinstance(reason, dict) and reason.get("type") == "abort"):
            said = reason.get("message") if isinstance(reason, dict) else None
            code = reason.get("status_code") if isinstance(reason, dict) else None
            return _refused(worker, code, said if isinstance(said, str) else "", "aborted the request", payload)
    if "error" in answer:
        error = answer["error"]
        code = error.get("code") if isinstance(error, dict) else None
        return _refused(worker, code, worker_reason(orjson.dumps(answer)), "answered an error", payload)
    return None


def _refused(worker: Worker, code: object, reason: str, what: str, payload: bytes) -> HalfFailed:
    """A prefill's abort or error inside a 200. Its own status code decides whose fault it is: a 4xx (a grammar
    that does not compile) and a grammar that admits no token are the request's, a 400 that is neither retried nor
    held against the worker; anything else is the worker's, a 502."""
    detail = f"{worker.url}: {payload[:200]!r}"
    if GRAMMAR_FAILED.decode() in reason:
        return grammar_failure(worker, payload)
    said = f": {clean_reason(reason)}" if reason else ""
    if isinstance(code, int) and 400 <= code < 500 and code != 429:
        return HalfFailed(worker, code, f"{_who(worker)} refused the request{said}", detail=detail)
    return HalfFailed(worker, 502, f"{_who(worker)} {what}{said}", detail=detail)


# What a worker's message may carry that a client must not read: a traceback, a path of the server's files, an
# internal address. SGLang 0.5.23 puts all three into some 400s (a pydantic error raised in its own code).
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):[ \t]*\n(?:[ \t]+[^\n]*(?:\n|$))*")  # its frames
_FRAME = re.compile(r'\s*File "[^"]*", line \d+[^\n]*')
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}[\\/]?")
_ADDRESS = re.compile(r"\b(?:https?|tcp|zmq|ipc)://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\blocalhost:\d+")
_REASON_CHARS = 500


def clean_reason(message: str) -> str:
    """A worker's message as a client may read it: no traceback, file path or internal address, one line, bounded."""
    message = _ADDRESS.sub("<address>", _PATH.sub("<path>", _FRAME.sub("", _TRACEBACK.sub("", message))))
    message = " ".join(message.split())
    return message if len(message) <= _REASON_CHARS else message[:_REASON_CHARS - 3] + "..."


def worker_reason(body: bytes | None) -> str:
    """The reason in a worker's error body, cleaned: SGLang's OpenAI shape ({"object": "error", "message"}), its
    native one ({"error": {"message"}} or {"error": "..."}), or "" when the body says none."""
    try:
        payload = orjson.loads(body or b"")
    except orjson.JSONDecodeError:
        return ""
    if isinstance(payload, dict) and "error" in payload:
        payload = payload["error"]
    message = payload.get("message") if isinstance(payload, dict) else payload
    return clean_reason(message) if isinstance(message, str) else ""


def clean_error_events(chunk: bytes, decode: Worker) -> bytes:
    """The chunk with each whole `data: {"error": ...}` event rewritten as the router's error (worker_reason):
    SGLang's own carries its shape, and may carry a traceback or a path of the worker's files."""
    events = chunk.split(b"\n\n")
    for i, event in enumerate(events):
        if event.startswith(b"data: {") and b'"error"' in event:
            try:
                payload = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                continue
            error = payload.get("error") if isinstance(payload, dict) else None
            if error is None:
                continue
            code = error.get("code") if isinstance(error, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            reason = worker_reason(event[6:]) or "no reason given"
            events[i] = b"data: " + orjson.dumps(error_body(status, f"decode {decode.worker_id}: {reason}"))
    return b"\n\n".join(events)
