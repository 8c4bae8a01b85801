"""One attempt alone (router/pd/attempt.py), driven against fake workers through each way it can end: delivered, the
client gone, a half failed before or after the client's first byte, a deadline passed. After each: its outcome, and
the books (in flight and prompt tokens back to 0, the breakers, the aborts each worker got, the metrics)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import pytest

from router.checks.validation import check_generate
from router.config import RouterConfig
from router.fleet.discovery import static_workers
from router.fleet.workers import WorkerPool
from router.metrics import RouterMetrics
from router.pd.attempt import Attempt, AttemptState, Dispatcher
from router.pd.failures import HalfFailed
from router.pd.request import PdRequest
from router.routing.policy import Choice
from router.transport.edge import Answer, StreamAnswer
from router.transport.upstream import UpstreamClient
from tests.fakes import Behaviour, FakeWorker, ServerThread


class Rig:
    """A prefill and a decode (fakes), and what the router keeps about them, for one attempt at a time."""

    def __init__(self, prefill_url: str, decode_url: str, **config):
        self.config = RouterConfig(bootstrap_url=None, prefill=[{"url": prefill_url, "kv_bootstrap_port": 8999}],
                                   decode=[{"url": decode_url}], **config)
        self.pool = WorkerPool(admission_check=False)
        self.pool.add_static(static_workers(self.config))
        self.prefill, self.decode = self.pool.workers["static-prefill-0"], self.pool.workers["static-decode-0"]
        self.metrics = RouterMetrics(self.pool)
        self.background: set[asyncio.Future] = set()

    async def run(self, body: dict, drive: Callable[[Attempt], Awaitable[object]],
                  prefill_work: int | None = None) -> tuple[Attempt, object]:
        """An attempt of `body` on the pair, driven by `drive`; returns once everything it left in the background
        (the aborts, the prefill's answer) is done. `prefill_work`: what the prefill policy counted it will compute."""
        client = UpstreamClient(self.config.connect_timeout, self.config.read_timeout)
        body = dict(body)  # the attempt adds its PD fields to it
        request = PdRequest("/generate", "test", body, check_generate(body), time.monotonic(),
                            self.config.total_timeout)
        request.start_attempt(self.prefill)
        attempt = Attempt(Dispatcher(client, self.metrics, self.background, self.config), request,
                          Choice(self.prefill, self.decode, prefill_work=prefill_work))
        try:
            result = await drive(attempt)
        finally:
            while self.background:
                await asyncio.wait_for(asyncio.gather(*list(self.background), return_exceptions=True), 15)
            await client.close()
        return attempt, result

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def books(self) -> dict:
        return {"in_flight": [self.prefill.in_flight, self.decode.in_flight],
                "prompt_tokens": [self.prefill.pending_prompt_tokens, self.prefill.pending_work_tokens],
                "breaker_failures": [self.prefill.breaker.failures, self.decode.breaker.failures],
                "aborts": [self.metric("pdcluster_router_aborts_sent_total", role=r) for r in ("prefill", "decode")]}


def attempt_on(prefill: FakeWorker, decode: FakeWorker, body: dict, drive, prefill_work: int | None = None,
               **config) -> tuple[Attempt, object, Rig]:
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        rig = Rig(p.url, d.url, **config)
        attempt, result = asyncio.run(rig.run(body, drive, prefill_work))
    assert attempt.state is attempt.outcome.ending  # ended once, as recorded
    attempt.end(AttemptState.DELIVERED)  # a second end() changes nothing
    assert attempt.state is attempt.outcome.ending
    return attempt, result, rig


async def relay(attempt: Attempt) -> list[bytes]:
    """The client's side of a stream, to its end, as the edge pulls it (router/transport/edge.py)."""
    answer = await attempt.answer()
    assert isinstance(answer, StreamAnswer)
    try:
        return [chunk async for chunk in answer.chunks]
    finally:
        answer.close()


STREAM = {"text": "hi", "stream": True}


def test_delivered_a_stream_gives_back_everything_and_aborts_nothing():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=3))
    attempt, chunks, rig = attempt_on(prefill, decode, STREAM, relay)
    assert attempt.outcome.ending is AttemptState.DELIVERED and attempt.outcome.aborted == ()
    assert b"".join(chunks).count(b"data: {") == 3
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 0], "aborts": [0, 0]}
    assert prefill.aborted == decode.aborted == []
    assert rig.metric("pdcluster_router_ttft_seconds_count", route="/generate") == 1
    assert rig.metric("pdcluster_router_request_duration_seconds_count", route="/generate") == 1  # the relay's
    assert rig.metric("pdcluster_router_stream_errors_total", route="/generate") == 0


def test_a_delivered_stream_reports_its_inter_token_latency_once():
    """The mean gap between its events after the first: 4 events 0.1 s apart give one observation of about 0.1 s."""
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=5, chunk_delay=0.1))
    attempt, _chunks, rig = attempt_on(prefill, decode, STREAM, relay)
    assert attempt.outcome.ending is AttemptState.DELIVERED
    assert rig.metric("pdcluster_router_itl_seconds_count", route="/generate") == 1
    assert 0.09 <= rig.metric("pdcluster_router_itl_seconds_sum", route="/generate") < 0.5


def test_a_delivered_answer_takes_its_prompt_off_the_books_though_the_prefills_answer_trails():
    """The decode answered, so the KV came: the prefill's work is done, and a policy that costs its queue must not
    count it (a trailing answer sent the next repeat of a cached prompt to the other prefill)."""
    prefill, decode = FakeWorker(Behaviour(delay=1.0)), FakeWorker()
    seen: dict = {}

    async def whole(attempt: Attempt) -> Answer | StreamAnswer:
        answer = await attempt.answer()
        seen.update(booked=attempt.prefill_half.prompt_tokens > 0, trailing=not attempt.prefill_half.future.done(),
                    after=[attempt.prefill.pending_prompt_tokens, attempt.decode.pending_prompt_tokens])
        return answer

    attempt, answer, rig = attempt_on(prefill, decode, {"text": "hi"}, whole)
    assert attempt.outcome.ending is AttemptState.DELIVERED and answer.status == 200
    assert seen == {"booked": True, "trailing": True, "after": [0, 0]}
    assert rig.books()["prompt_tokens"] == [0, 0]  # and not taken off twice when the prefill's answer came


def test_a_prompt_predicted_cached_books_only_what_the_prefill_will_compute():
    """cache_aware weighs a prefill's queue by the tokens it will compute: a queued repeat of a prompt it holds is
    little work, and must not send the next repeat to a prefill that holds nothing."""
    seen: dict = {}

    async def whole(attempt: Attempt) -> Answer | StreamAnswer:
        answering = asyncio.ensure_future(attempt.answer())
        while attempt.prefill_half is None:
            await asyncio.sleep(0.01)
        seen.update(prompt=attempt.prefill.pending_prompt_tokens, work=attempt.prefill.pending_work_tokens,
                    decode_work=attempt.decode.pending_work_tokens)
        return await answering

    attempt, answer, rig = attempt_on(FakeWorker(Behaviour(delay=0.5)), FakeWorker(Behaviour(delay=0.5)),
                                      {"text": "the same long prompt " * 40}, whole,
                                      prefill_work=3)  # cache_aware's count: all but 3 of its tokens held
    assert answer.status == 200 and seen["prompt"] > 40
    assert seen == {"prompt": attempt.request.checked.prompt_tokens, "work": 3, "decode_work": 3}
    assert rig.books()["prompt_tokens"] == [0, 0]


def test_delivered_a_whole_answer():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=4))

    async def whole(attempt: Attempt) -> Answer | StreamAnswer:
        return await attempt.answer()

    attempt, answer, rig = attempt_on(prefill, decode, {"text": "hi"}, whole)
    assert isinstance(answer, Answer) and json.loads(answer.body)["output_ids"] == [0, 1, 2, 3]
    assert attempt.outcome.ending is AttemptState.DELIVERED
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 0], "aborts": [0, 0]}
    assert rig.metric("pdcluster_router_request_duration_seconds_count", route="/generate") == 0  # service.py's


@pytest.mark.parametrize("when", ["before the relay began", "mid-relay"])
def test_client_gone_both_halves_are_aborted_and_no_worker_is_blamed(when):
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(chunks=3, chunk_delay=60))

    async def leave(attempt: Attempt) -> None:
        answer = await attempt.answer()
        assert isinstance(answer, StreamAnswer)
        if when == "mid-relay":
            assert b"data: {" in await anext(answer.chunks)
        # what the edge does whenever an answer ends (router/transport/edge.py, _end_stream)
        await answer.chunks.aclose()
        answer.close()

    attempt, _, rig = attempt_on(prefill, decode, STREAM, leave)
    assert attempt.outcome.ending is AttemptState.CLIENT_GONE and attempt.outcome.failure is None
    assert attempt.outcome.aborted == (rig.prefill, rig.decode)
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 0], "aborts": [1, 1]}
    assert prefill.aborted == decode.aborted == [decode.received[0]["rid"]]
    assert rig.metric("pdcluster_router_stream_errors_total", route="/generate") == 0


def test_client_gone_before_the_answer_started():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(hang=True))

    async def cancelled(attempt: Attempt) -> None:
        task = asyncio.ensure_future(attempt.answer())
        await asyncio.sleep(0.3)
        task.cancel()  # what the edge does when the client disconnects (router/transport/edge.py)
        with pytest.raises(asyncio.CancelledError):
            await task

    attempt, _, rig = attempt_on(prefill, decode, {"text": "hi"}, cancelled)
    assert attempt.outcome.ending is AttemptState.CLIENT_GONE
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 0], "aborts": [1, 1]}


def test_failed_before_the_first_byte_the_failed_half_is_blamed_and_the_other_aborted():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(status=503))

    async def refused(attempt: Attempt) -> HalfFailed:
        with pytest.raises(HalfFailed) as failed:
            await attempt.answer()
        return failed.value

    attempt, failure, rig = attempt_on(prefill, decode, STREAM, refused)
    assert isinstance(failure, HalfFailed) and failure.retryable and failure.worker is rig.decode
    assert attempt.outcome.ending is AttemptState.FAILED_BEFORE_FIRST_BYTE and attempt.outcome.failure is failure
    assert attempt.outcome.aborted == (rig.prefill,)
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 1], "aborts": [1, 0]}
    assert rig.decode.probe_healthy  # a 5xx answer is the breaker's business; only a broken connection ejects
    assert rig.metric("pdcluster_router_worker_ejections_total", role="decode") == 0


def test_failed_after_the_first_byte_the_stream_ends_with_an_error_event_and_the_worker_is_ejected():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=5, drop_after_chunks=2))
    attempt, chunks, rig = attempt_on(prefill, decode, STREAM, relay)
    assert attempt.outcome.ending is AttemptState.FAILED_AFTER_FIRST_BYTE
    assert attempt.outcome.failure is not None and attempt.outcome.failure.transport
    error = json.loads(chunks[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "dropped the connection" in error["message"]
    assert attempt.outcome.aborted == (rig.prefill,)
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 1], "aborts": [1, 0]}
    assert not rig.decode.probe_healthy  # out of rotation until a probe succeeds
    assert rig.metric("pdcluster_router_worker_ejections_total", role="decode") == 1
    assert rig.metric("pdcluster_router_stream_errors_total", route="/generate") == 1


def test_deadline_first_token_timeout_aborts_both_and_blames_no_worker():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(first_chunk_delay=60))
    attempt, chunks, rig = attempt_on(prefill, decode, STREAM, relay, first_token_timeout=0.5)
    assert attempt.outcome.ending is AttemptState.DEADLINE
    error = json.loads(chunks[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == 504 and "first_token_timeout (0.5s)" in error["message"]
    assert attempt.outcome.aborted == (rig.prefill, rig.decode)
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 0], "aborts": [1, 1]}
    assert rig.decode.probe_healthy
    assert rig.metric("pdcluster_router_stream_errors_total", route="/generate") == 1


def test_deadline_total_timeout_before_the_answer_started():
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(hang=True))

    async def timed_out(attempt: Attempt) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(attempt.request.deadline - time.monotonic()):  # as router/service.py
                await attempt.answer()

    attempt, _, rig = attempt_on(prefill, decode, {"text": "hi"}, timed_out, total_timeout=0.5)
    assert attempt.outcome.ending is AttemptState.DEADLINE
    assert rig.books() == {"in_flight": [0, 0], "prompt_tokens": [0, 0], "breaker_failures": [0, 0], "aborts": [1, 1]}
