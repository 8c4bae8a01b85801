"""What a failed half means to the client: the status it gets, and whether the router tries a new pair."""

from __future__ import annotations

import json

import pytest

from pdcluster.common.protocol import Role
from router.fleet.workers import Worker
from router.pd.failures import DeadlinePassed, halves_to_abort, status_failure, transport_failure
from router.transport.upstream import ConnectFailed, ConnectionDropped, ReadTimeout

DECODE = Worker("d", Role.DECODE, "http://10.0.0.2:30000")
PREFILL = Worker("p", Role.PREFILL, "http://10.0.0.1:30000")


@pytest.mark.parametrize(
    ("error", "status", "retryable", "fragment"),
    [
        (ConnectFailed("connect to 10.0.0.2:30000 failed: Connection refused"), 502, True, "decode d unreachable"),
        (ConnectionDropped("connection closed: [Errno 104] Connection reset by peer"), 502, True,
         "decode d dropped the connection"),
        (ReadTimeout(300.0), 504, False, "decode d sent nothing for read_timeout (300.0s)"),  # may be running still
    ],
)
def test_transport_failures_name_the_worker_not_its_address_or_the_os_error(error, status, retryable, fragment):
    failure = transport_failure(DECODE, error)
    assert (failure.status, failure.retryable, failure.transport) == (status, retryable, True)
    answer = failure.answer()
    message = json.loads(answer.body)["error"]["message"]
    assert answer.status == status and message == fragment
    assert "10.0.0.2" in failure.detail and str(error) in failure.detail  # for the log


@pytest.mark.parametrize(("worker_status", "client_status", "retryable"),
                         [(503, 502, True), (500, 502, True), (429, 429, True), (400, 400, False)])
def test_status_failures(worker_status, client_status, retryable):
    failure = status_failure(DECODE, worker_status, b'{"error": {"message": "from the worker"}}')
    assert (failure.status, failure.retryable, failure.transport) == (client_status, retryable, False)


def test_a_workers_own_4xx_keeps_its_reason_in_the_routers_shape_and_a_5xx_gets_the_routers_error():
    own = status_failure(DECODE, 400, b'{"error": {"message": "prompt too long"}}').answer()
    assert own.status == 400
    assert json.loads(own.body)["error"] == {"message": "decode d answered 400: prompt too long",
                                             "type": "invalid_request_error", "param": None, "code": 400}
    crashed = status_failure(DECODE, 500, b"Internal Server Error").answer()
    assert crashed.status == 502
    assert json.loads(crashed.body)["error"]["message"] == "decode d answered 500"


def test_the_other_half_is_aborted_and_both_when_the_router_ends_the_attempt():
    assert halves_to_abort(status_failure(DECODE, 503, b""), PREFILL, DECODE) == (PREFILL,)
    assert halves_to_abort(transport_failure(PREFILL, ConnectFailed("refused")), PREFILL, DECODE) == (DECODE,)
    assert halves_to_abort(None, PREFILL, DECODE) == (PREFILL, DECODE)  # the client left, or total_timeout
    deadline = DeadlinePassed(DECODE, "no token within first_token_timeout (1.0s)")
    assert halves_to_abort(deadline, PREFILL, DECODE) == (PREFILL, DECODE)
    assert not deadline.counts_against_worker and not deadline.transport  # the router's limit, not the worker's fault
    # A half the router stopped waiting for may be working on it still (a decode generating): both are aborted.
    assert halves_to_abort(transport_failure(DECODE, ReadTimeout(600.0)), PREFILL, DECODE) == (PREFILL, DECODE)


def test_a_grammar_that_admits_no_token_is_the_requests_fault_not_the_workers():
    """SGLang answers 500 "Grammar accept_token failed" for e.g. `ebnf: root ::= root`: a 400 for the client, no
    retry, and the worker's breaker hears nothing (five such requests would otherwise take it out of rotation)."""
    payload = b'{"error": {"message": "Grammar accept_token failed: token 68 rejected"}}'
    failure = status_failure(PREFILL, 500, payload)
    assert (failure.status, failure.retryable, failure.counts_against_worker) == (400, False, False)
    body = json.loads(failure.answer().body)["error"]
    assert body["code"] == 400 and "grammar admits no token" in body["message"]
    assert status_failure(PREFILL, 500, b"internal error").counts_against_worker  # any other 500 still counts
