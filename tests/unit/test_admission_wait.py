"""Admission by predicted wait (router/admission/queue_wait.py, router/admission/gate.py): the wait predicted from a
prefill's booked tokens and its rate (profile, then measured), the router's queue (FIFO per class, by priority, bounded
in length and time), the 429's Retry-After, and a router that refuses before any worker sees the request."""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import ExitStack
from datetime import UTC, datetime

import httpx
import pytest
from pydantic import ValidationError

from pdcluster.common.capacity import DecodePoint, PrefillPoint, Profile
from pdcluster.common.protocol import ModelIdentity, Role
from router.admission.gate import Gate, Refused
from router.admission.queue_wait import MEASURED_AFTER, WaitModel, record_prefill
from router.app import create_app
from router.config import AdmissionConfig, PriorityClass, RouterConfig
from router.fleet.workers import Worker, WorkerPool
from router.metrics import RouterMetrics
from tests.fakes import Behaviour, FakeWorker, ServerThread


def profile(model: str = "m") -> Profile:
    return Profile(model=model, hardware="test", measured_at=datetime(2026, 1, 1, tzinfo=UTC), method="by hand",
                   prefill=[PrefillPoint(prompt_tokens=64, tokens_per_s=100.0),
                            PrefillPoint(prompt_tokens=1024, tokens_per_s=50.0)],
                   decode=[DecodePoint(batch=1, context_tokens=64, itl_s=0.01)])


def prefill(worker_id: str = "p0", model: str = "m", pending: int = 0) -> Worker:
    identity = ModelIdentity(model_path=f"/models/{model}", served_model_name=model, page_size=1,
                             kv_cache_dtype="auto", transfer_backend="mooncake")
    worker = Worker(worker_id, Role.PREFILL, f"http://{worker_id}", "h", 1, identity=identity)
    worker.pending_work_tokens = pending
    return worker


def test_the_wait_is_the_booked_tokens_over_the_profiles_slowest_rate_until_measured():
    model = WaitModel(profile("m"), unmeasured_tokens_per_s=10.0)
    assert model.wait(prefill(pending=1000)) == pytest.approx(20.0)  # 1000 tokens at 50 tokens/s
    assert model.wait(prefill(pending=1000), extra_tokens=500) == pytest.approx(30.0)
    assert model.wait(prefill(model="other", pending=1000)) == pytest.approx(100.0)  # not its model: 10 tokens/s


def test_a_prefills_rate_is_measured_over_its_service_times():
    worker = prefill()
    record_prefill(worker, 400, sent_at=0.0, done_at=2.0)  # 400 tokens in 2 s
    assert (worker.prefill_rate, worker.prefill_rate_samples) == (200.0, 1)
    record_prefill(worker, 400, sent_at=1.0, done_at=3.0)  # queued behind the first until 2.0: 400 tokens in 1 s
    assert worker.prefill_rate == pytest.approx(0.3 * 400 + 0.7 * 200)
    record_prefill(worker, 0, sent_at=3.0, done_at=3.5)  # all cached: no sample, but the prefill was busy till 3.5
    assert (worker.prefill_rate_samples, worker.prefill_busy_until) == (2, 3.5)


def test_halves_of_one_forward_answering_milliseconds_apart_count_over_the_time_the_forward_took():
    # SGLang computes three 256-token prompts sent together in one forward of 2 s; their answers arrive 5 ms apart.
    # Alone, the second and third half read as 51,200 tokens/s, and a queue of 19,000 tokens as a wait of 0.4 s.
    worker = prefill()
    for done in (2.0, 2.005, 2.010):
        record_prefill(worker, 256, sent_at=0.0, done_at=done)
    assert (worker.prefill_rate, worker.prefill_rate_samples) == (128.0, 1)  # the first: 256 tokens in 2 s
    record_prefill(worker, 256, sent_at=2.010, done_at=4.010)  # the next forward: the two left over count with it
    assert worker.prefill_rate_samples == 2
    assert worker.prefill_rate == pytest.approx(0.3 * 768 / 2.010 + 0.7 * 128.0)


def test_before_enough_answers_the_lower_rate_stands_then_the_measured_one():
    model = WaitModel(profile("m"))
    worker = prefill(pending=1000)
    record_prefill(worker, 1000, 0.0, 1.0)  # 1000 tokens/s measured once: the profile's 50 still stands
    assert model.rate(worker) == pytest.approx(50.0)
    for i in range(1, MEASURED_AFTER):
        record_prefill(worker, 1000, float(i), float(i + 1))
    assert model.rate(worker) == pytest.approx(1000.0) and model.wait(worker) == pytest.approx(1.0)
    slow = prefill(pending=1000)
    record_prefill(slow, 10, 0.0, 1.0)  # 10 tokens/s, slower than the profile's: it stands at once
    assert model.rate(slow) == pytest.approx(10.0)


def admission(**classes: PriorityClass) -> AdmissionConfig:
    return AdmissionConfig(enabled=True, unmeasured_tokens_per_s=100.0, classes={"default": PriorityClass(), **classes})


def gate_on(*workers: Worker, config: AdmissionConfig) -> Gate:
    pool = WorkerPool(workers={w.worker_id: w for w in workers}, admission_check=False)
    return Gate(config, pool, RouterMetrics(pool), WaitModel(None, config.unmeasured_tokens_per_s))


def test_over_the_bound_without_a_queue_is_a_429_with_retry_after_from_the_drain_rate():
    # Two prefills at 100 tokens/s each, 3000 and 2500 tokens booked: the least wait is 25 s, 5 s over the bound;
    # nothing queued ahead: Retry-After = ceil(5) = 5.
    busy = (prefill("p0", pending=3000), prefill("p1", pending=2500))
    gate = gate_on(*busy, config=admission(default=PriorityClass(max_predicted_wait=20, queue_wait=0)))

    async def scenario() -> Refused:
        with pytest.raises(Refused) as refused:
            async with gate.admitted("default", 100):
                pass
        return refused.value

    refused = asyncio.run(scenario())
    assert (refused.status, refused.retry_after, refused.reason) == (429, 5, "predicted_wait")
    assert "would wait 25.0s" in refused.message
    assert gate.metrics.registry.get_sample_value("pdcluster_router_admission_refusals_total",
                                                  {"class": "default", "reason": "predicted_wait"}) == 1
    # Queued ahead of a new request: 1000 tokens more to drain at 200 tokens/s (both prefills): 5 + 5 s.
    gate.queues["default"].append("t", 1.0, 1000, type("W", (), {"tokens": 1000})())  # type: ignore[arg-type]
    assert gate.retry_after("default", 25.0) == 10


def test_the_queue_is_fifo_per_class_and_serves_the_higher_class_first():
    worker = prefill(pending=3000)  # 30 s at 100 tokens/s: over every bound
    gate = gate_on(worker, config=admission(high=PriorityClass(priority=10, max_predicted_wait=20, queue_wait=5)))
    order: list[str] = []

    async def request(name: str, klass: str) -> None:
        async with gate.admitted(klass, 500):
            order.append(name)
            gate.dispatched()
            worker.pending_work_tokens += 500  # its prefill half books it

    async def scenario() -> None:
        tasks = []
        for name, klass in (("d1", "default"), ("d2", "default"), ("h1", "high"), ("h2", "high")):
            tasks.append(asyncio.create_task(request(name, klass)))
            await asyncio.sleep(0.01)
        assert [len(gate.queues[c]) for c in ("default", "high")] == [2, 2] and not order
        worker.pending_work_tokens = 0  # the prefill drained: 500 tokens (5 s) each, four fit under 20 s one by one
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert order == ["h1", "h2", "d1", "d2"]
    assert gate.reserved == 0


def test_a_full_queue_and_a_long_wait_are_429s_and_leave_nothing_reserved():
    worker = prefill(pending=3000)
    gate = gate_on(worker, config=admission(default=PriorityClass(max_predicted_wait=20, queue_wait=0.2,
                                                                  queue_length=1)))

    async def one() -> str:
        try:
            async with gate.admitted("default", 100):
                return "served"
        except Refused as refused:
            return refused.reason

    async def scenario() -> list[str]:
        return list(await asyncio.gather(one(), one()))

    started = time.monotonic()
    assert sorted(asyncio.run(scenario())) == ["queue_full", "queue_timeout"]
    assert time.monotonic() - started < 2
    assert gate.reserved == 0 and not gate.queues["default"]
    assert gate.metrics.registry.get_sample_value("pdcluster_router_admission_queue_length", {"class": "default"}) == 0


def test_an_admitted_request_is_reserved_until_its_prefill_books_it():
    worker = prefill(pending=0)
    gate = gate_on(worker, config=admission(default=PriorityClass(max_predicted_wait=20, queue_wait=0)))

    async def scenario() -> None:
        async with gate.admitted("default", 2500):  # 25 s reserved: the next would wait that long
            assert gate.predicted_wait() == pytest.approx(25.0)
            with pytest.raises(Refused):
                async with gate.admitted("default", 10):
                    pass
            gate.dispatched()
            assert gate.reserved == 0

    asyncio.run(scenario())


def test_every_bound_is_at_most_half_of_sglangs_kv_wait_timeout():
    with pytest.raises(ValidationError, match="at most half of kv_wait_timeout"):
        AdmissionConfig(kv_wait_timeout=60, classes={"default": PriorityClass(max_predicted_wait=31)})
    with pytest.raises(ValidationError, match="'default' is required"):
        AdmissionConfig(classes={"gold": PriorityClass()})


def test_a_router_refuses_with_429_before_any_worker_sees_the_request():
    """A long prompt in flight on the only prefill (the fakes answer it after 2 s); the next request's predicted wait
    is over a tiny bound: a 429 in milliseconds, OpenAI's error shape, Retry-After, and neither worker saw it."""
    slow_prefill, decode = FakeWorker(Behaviour(delay=2.0)), FakeWorker(Behaviour(delay=2.0))
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(slow_prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                              decode=[{"url": d.url}], admission_check=False,
                              admission={"enabled": True, "unmeasured_tokens_per_s": 10,
                                         "classes": {"default": {"max_predicted_wait": 0.5, "queue_wait": 0}}})
        router = stack.enter_context(ServerThread(create_app(config)))
        with httpx.Client(base_url=router.url, timeout=30) as client:
            long = stack.enter_context(ThreadedPost(client, "/generate", {"text": "x" * 400}))
            assert wait_for(lambda: len(slow_prefill.received) == 1)
            started = time.monotonic()
            refused = client.post("/v1/completions", json={"model": "fake", "prompt": "hi"})
            took = time.monotonic() - started
            assert long.result().status_code == 200
    assert refused.status_code == 429 and took < 0.5
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == 429 and "retry after" in error["message"]
    assert int(refused.headers["retry-after"]) == math.ceil(200 / 10 - 0.5)  # 400 characters: ~200 tokens booked
    assert len(slow_prefill.received) == 1 and len(decode.received) == 1  # only the long one's halves


class ThreadedPost:
    """A POST sent from a thread, its response read by `result`."""

    def __init__(self, client: httpx.Client, path: str, body: dict):
        import concurrent.futures
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.future = self.pool.submit(client.post, path, json=body)

    def __enter__(self) -> ThreadedPost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True)

    def result(self) -> httpx.Response:
        return self.future.result(timeout=30)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


KV_WAIT_TIMEOUT = "Request 7 timed out after 60.0s in KVPoll.WaitingForInput"  # SGLang 0.5.23's decode


@pytest.mark.parametrize(("prefill_delay", "decode_delay", "decode_blamed"), [(3.0, 0.0, 0), (0.0, 0.5, 1)])
def test_a_kv_wait_timeout_the_prefills_queue_explains_is_not_held_against_the_decode(prefill_delay, decode_delay,
                                                                                        decode_blamed):
    """The decode waited out SGLang's KV timeout: while its prefill had not answered (queued: the wait is the
    prefill's), its breaker does not hear of it; after the prefill answered (the KV should have come), it does."""
    from router.pd.failures import HalfFailed
    from tests.unit.test_attempt import attempt_on

    failing = Behaviour(status=500, error_message=KV_WAIT_TIMEOUT, delay=decode_delay)

    async def refused(attempt) -> HalfFailed:
        with pytest.raises(HalfFailed) as failed:
            await attempt.answer()
        return failed.value

    _, failure, rig = attempt_on(FakeWorker(Behaviour(delay=prefill_delay)), FakeWorker(failing),
                                 {"text": "hi"}, refused)
    assert failure.worker is rig.decode and failure.status == 502
    assert rig.books()["breaker_failures"] == [0, decode_blamed]
