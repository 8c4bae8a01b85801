"""Liveness (router/liveness.py): a worker that stops answering, or whose scheduler is stuck (its /health waits while
its load snapshot stands still), is ejected within the thresholds, the requests open on it end (retried before
their first byte, an SSE error event after), and it is readmitted once it answers again. The verdict with a fake
clock; the whole router with fake workers that freeze like a SIGSTOPped SGLang."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
from fastapi import FastAPI, Request

from pdcluster.protocol import Role
from router.app import create_app
from router.config import RouterConfig
from router.liveness import (
    DEFAULT_SECONDS_PER_TOKEN,
    SAFETY,
    Liveness,
    LivenessWatch,
    read_prefill_totals,
    read_running,
    read_snapshot,
    silent_tokens,
)
from router.workers import Worker, WorkerPool
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.helpers import until

CONFIG = RouterConfig(liveness_interval=1.0, liveness_timeout=5.0, stall_timeout=6.0)


def snapshot(stamp: float) -> dict:
    return {"loads": [{"timestamp": stamp, "num_running_reqs": 1, "num_waiting_reqs": 0}]}


# ----- the verdict, on a fake clock -----

def test_a_worker_that_answers_is_live_and_one_silent_past_the_timeout_is_hung():
    live = Liveness(last_answer=0.0, last_progress=0.0)
    live.answered(1.0, read_snapshot(snapshot(100.0)))
    assert live.verdict(5.9, CONFIG) == ""
    assert live.verdict(6.1, CONFIG) == "no answer to liveness probes for 5.1s"
    live.answered(6.2, read_snapshot(snapshot(100.0)))  # answers again: live at once
    assert live.verdict(6.3, CONFIG) == ""


def test_health_waiting_while_the_snapshot_stands_still_is_a_stalled_scheduler():
    live = Liveness(last_answer=0.0, last_progress=0.0)
    live.answered(1.0, read_snapshot(snapshot(100.0)))
    live.health_sent(2.0)  # SGLang's /health generation waits in the scheduler from t=2
    for t in range(2, 9):  # the HTTP side answers, the scheduler publishes nothing new
        live.answered(float(t), read_snapshot(snapshot(100.0)))
        assert live.verdict(float(t), CONFIG) == ""
    live.health_sent(5.0)  # a second probe after the first failed: still waiting since t=2
    assert live.verdict(8.5, CONFIG).startswith(
        "scheduler made no progress for 6.5s (/health waiting, load snapshot still; allowed 6.0s")
    live.answered(9.0, read_snapshot(snapshot(109.0)))  # SIGCONT: it publishes
    assert live.verdict(9.0, CONFIG) == ""


def test_a_slow_health_with_a_moving_snapshot_and_a_still_snapshot_with_health_answering_are_live():
    busy = Liveness(last_answer=0.0, last_progress=0.0)
    busy.health_sent(0.0)  # a long queue: /health waits its turn, but every batch publishes a snapshot
    idle = Liveness(last_answer=0.0, last_progress=0.0)
    for t in range(30):
        busy.answered(float(t), read_snapshot(snapshot(100.0 + t)))
        idle.answered(float(t), read_snapshot(snapshot(100.0)))  # idle: nothing published, ever
        idle.health_sent(float(t))
        idle.health_answered()  # ... and /health answers in a second
        assert busy.verdict(float(t), CONFIG) == "" and idle.verdict(float(t), CONFIG) == ""


def test_a_long_prompt_in_flight_gives_the_scheduler_its_time_and_no_more():
    """One forward pass of a 3000-token prompt takes ~15 s on a CPU, in silence; with nothing in flight, silence
    past stall_timeout is a stuck scheduler. The worker's own prefill cost per token comes from its snapshots."""
    live = Liveness(last_answer=0.0, last_progress=0.0)
    totals = (5_000_000.0, 1000)  # SGLang says: 5 s spent prefilling 1000 tokens, 5 ms a token
    live.answered(0.0, read_snapshot(snapshot(100.0)), totals)
    live.health_sent(0.0)
    for t in range(1, 50):
        live.answered(float(t), read_snapshot(snapshot(100.0)), totals)
        assert live.verdict(float(t), CONFIG, pending_tokens=3000) == ""  # allowed 6 + 3 x 0.005 x 3000 = 51 s
    assert live.verdict(52.0, CONFIG, pending_tokens=3000).startswith("scheduler made no progress for 52.0s")
    assert live.verdict(7.0, CONFIG, pending_tokens=0).startswith("scheduler made no progress for 7.0s")


def test_a_prefill_shared_with_other_routers_gets_one_whole_forward_pass_whatever_this_router_sent():
    """Routers sharing a prefill (the chart runs two) cannot see each other's prompts: while another router's
    3000-token prompt is in a 15 s forward pass, this one has nothing in flight there and its /health waits. The
    prefill's largest forward pass (its chunked prefill size, registered) is what it may be silent for; a decode,
    and a static worker that did not register it, are judged by what this router sent them."""
    prefill = Worker("p", Role.PREFILL, "http://p", forward_tokens=4096)
    assert silent_tokens(prefill) == 4096  # nothing of ours in flight
    prefill.pending_prompt_tokens = 9000  # ours: chunks of at most 4096, a snapshot after each
    assert silent_tokens(prefill) == 4096
    decode = Worker("d", Role.DECODE, "http://d", forward_tokens=4096)
    decode.pending_prompt_tokens = 7
    static = Worker("s", Role.PREFILL, "http://s", static=True)
    static.pending_prompt_tokens = 300
    assert (silent_tokens(decode), silent_tokens(static)) == (7, 300)

    live = Liveness(last_answer=0.0, last_progress=0.0)
    totals = (5_000_000.0, 1000)  # 5 ms a prompt token: a 4096-token pass is allowed 6 + 3 x 0.005 x 4096 = 67 s
    live.answered(0.0, read_snapshot(snapshot(100.0)), totals)
    live.health_sent(0.0)
    idle_here = Worker("p", Role.PREFILL, "http://p", forward_tokens=4096)  # this router has nothing on it
    for t in range(1, 67):
        live.answered(float(t), read_snapshot(snapshot(100.0)), totals)
        assert live.verdict(float(t), CONFIG, silent_tokens(idle_here)) == ""
    assert live.verdict(68.0, CONFIG, 4096).startswith("scheduler made no progress for 68.0s")


def snapshot_of(stamp: float, running: int) -> dict:
    return {"loads": [{"timestamp": stamp, "num_running_reqs": running, "num_waiting_reqs": 0}]}


def feed(live: Liveness, t: float, stamp: float, running: int) -> None:
    payload = snapshot_of(stamp, running)
    live.answered(t, read_snapshot(payload), None, read_running(payload))


def test_a_decode_with_slow_steps_may_be_as_silent_as_it_was_between_its_snapshots():
    """bench.cluster on SmolLM2: decode steps of ~1 s with 6 streams, a snapshot every 15 steps, and a /health that
    waited past 6 s: the healthy decode was ejected and its 6 streams ended. What it was seen to take between two
    snapshots while busy (15 s here) is what it may be silent for, x SAFETY; a decode with fast steps is still
    judged at stall_timeout, and neither an idle gap nor a gap that ended while it was hung counts."""
    slow = Liveness(last_answer=0.0, last_progress=0.0)
    for publish in range(4):  # busy: a snapshot every 15 s
        feed(slow, 15.0 * publish, 100.0 + 15 * publish, running=6)
    assert slow.busy_gap == 15.0
    slow.health_sent(45.0)
    for t in range(46, 45 + 51):
        slow.answered(float(t), slow.stamps)
        assert slow.verdict(float(t), CONFIG) == ""  # 6 + 3 x 15 = 51 s allowed
    assert slow.verdict(97.0, CONFIG).startswith("scheduler made no progress for 52.0s")
    assert "3x its longest gap between snapshots while busy, 15.0s" in slow.verdict(97.0, CONFIG)

    fast = Liveness(last_answer=0.0, last_progress=0.0)
    for i in range(20):
        feed(fast, 0.5 * i, 100.0 + i, running=2)
    feed(fast, 10.0, 130.0, running=0)  # the requests finished: the idle transition publishes
    feed(fast, 300.0, 140.0, running=1)  # idle for 290 s: not a busy gap
    assert fast.busy_gap == 0.5
    fast.health_sent(300.0)
    fast.answered(307.5, fast.stamps)  # its HTTP side answers; the scheduler is stuck
    assert fast.verdict(307.6, CONFIG).startswith("scheduler made no progress for 7.6s")  # allowed 6 + 3 x 0.5

    stopped = Liveness(last_answer=0.0, last_progress=0.0)
    feed(stopped, 0.0, 100.0, running=3)
    stopped.reason = "no answer to liveness probes for 5.1s"  # SIGSTOPped for a minute, then SIGCONT
    feed(stopped, 60.0, 101.0, running=3)
    assert stopped.busy_gap == 0.0
    assert read_running({"loads": [{"num_running_reqs": 2}, {"num_running_reqs": 1}]}) == 3
    assert read_running({"loads": [{"timestamp": 1.0}]}) is None


def test_before_a_worker_has_prefilled_much_its_cost_per_token_is_taken_to_be_high():
    live = Liveness(last_answer=0.0, last_progress=0.0)
    live.answered(0.0, None, (1000.0, 3))  # a few tokens of health probes: too little to judge by
    assert live.allowance(CONFIG, 1000) == CONFIG.stall_timeout + SAFETY * DEFAULT_SECONDS_PER_TOKEN * 1000
    assert read_prefill_totals({"loads": [{"total_prefill_busy_us": 10, "total_prefill_uncached_tokens": 2},
                                          {"total_prefill_busy_us": 5, "total_prefill_uncached_tokens": 1}]}) == (15, 3)
    assert read_prefill_totals({"loads": [{"timestamp": 1}]}) is None


def test_snapshots_are_read_from_v1_loads_and_anything_else_is_no_snapshot():
    assert read_snapshot({"loads": [{"timestamp": 1.5}, {"timestamp": 2.5}]}) == (1.5, 2.5)
    assert read_snapshot({"loads": []}) is None
    assert read_snapshot({"detail": "Not Found"}) is None and read_snapshot([1]) is None


# ----- the router, with fake workers that freeze -----

class FreezableWorker(FakeWorker):
    """A fake SGLang worker with /v1/loads. `frozen`: nothing answers (a SIGSTOPped process tree); `stalled`: the
    HTTP side answers but the scheduler is stuck (no token, /health waits, the snapshot stands still); `quiet`:
    the snapshot stands still only (an idle SGLang publishes nothing)."""

    def __init__(self, behaviour: Behaviour) -> None:
        super().__init__(behaviour)
        self.frozen = self.stalled = self.quiet = False
        self.stamp = time.time()

    def app(self) -> FastAPI:
        app = super().app()

        @app.middleware("http")
        async def freeze(request: Request, call_next):
            while self.frozen or (self.stalled and request.url.path == "/health"):
                await asyncio.sleep(0.01)
            return await call_next(request)

        @app.get("/v1/loads")
        async def loads() -> dict:
            if not (self.stalled or self.quiet):
                self.stamp = time.time()
            return {"loads": [{"timestamp": self.stamp, "num_running_reqs": 0, "num_waiting_reqs": 0}]}

        return app

    async def _stream(self, b: Behaviour, rid: str | None):
        async for chunk in super()._stream(b, rid):
            while self.frozen or self.stalled:
                await asyncio.sleep(0.01)
            yield chunk


FAST = {"liveness_interval": 0.2, "liveness_timeout": 1.0, "stall_timeout": 1.5, "health_interval": 0.2}


@contextmanager
def pd_cluster(prefill: FakeWorker, decodes: list[FakeWorker], **config):
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        ds = [stack.enter_context(ServerThread(d.app())) for d in decodes]
        cfg = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                           decode=[{"url": d.url} for d in ds], expose_worker_ids=True, **{**FAST, **config})
        router = stack.enter_context(ServerThread(create_app(cfg)))
        yield router.url
        for d in decodes:  # let the servers stop
            d.frozen = d.stalled = d.quiet = False




def healthy(url: str) -> dict[str, bool]:
    return {w["worker_id"]: w["healthy"] for w in httpx.get(f"{url}/ready", timeout=5).json()["workers"]}


def streamed(url: str, decodes: list[FreezableWorker], freeze: str) -> tuple[list[str], float, str]:
    """Start a stream, freeze (or stall) its decode after the first event, read to the end."""
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 100}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as response:
        assert response.status_code == 200
        victim = response.headers["x-pdcluster-decode"]
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data:"))]
        setattr(decodes[int(victim[-1])], freeze, True)
        frozen_at = time.monotonic()
        events += [line for line in lines if line.startswith("data:")]
        return events, time.monotonic() - frozen_at, victim


def test_a_frozen_decode_is_ejected_its_stream_ends_with_an_error_and_the_other_decode_serves():
    prefill = FakeWorker()
    decodes = [FreezableWorker(Behaviour(chunks=100, chunk_delay=0.05)) for _ in range(2)]
    with pd_cluster(prefill, decodes) as url:
        events, ended_after, victim = streamed(url, decodes, "frozen")
        assert ended_after < FAST["liveness_timeout"] + 3  # the threshold, plus a busy machine's slack
        assert events[-1] != "data: [DONE]"
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == 502 and "decode" in error["message"] and victim in error["message"]
        assert healthy(url)[victim] is False
        other = {"static-decode-0", "static-decode-1"} - {victim}
        served = {httpx.post(f"{url}/generate", json={"text": "next"}, timeout=10).headers["x-pdcluster-decode"]
                  for _ in range(4)}
        assert served == other
        decodes[int(victim[-1])].frozen = False  # SIGCONT
        assert until(lambda: healthy(url)[victim], timeout=5)


def test_a_request_waiting_on_a_frozen_decode_is_retried_on_the_other_one():
    prefill = FakeWorker()
    decodes = [FreezableWorker(Behaviour(chunks=3)) for _ in range(2)]
    with pd_cluster(prefill, decodes) as url:
        decodes[0].frozen = True
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:  # round robin: some of them land on the frozen decode first
            answers = list(pool.map(lambda i: httpx.post(f"{url}/generate", json={"text": f"q{i}"}, timeout=30),
                                    range(4)))
        assert [a.status_code for a in answers] == [200] * 4
        assert {a.headers["x-pdcluster-decode"] for a in answers} == {"static-decode-1"}
        assert time.monotonic() - started < FAST["liveness_timeout"] + 4


def test_a_stalled_scheduler_is_ejected_though_its_http_side_answers():
    prefill = FakeWorker()
    decodes = [FreezableWorker(Behaviour(chunks=100, chunk_delay=0.05)) for _ in range(2)]
    with pd_cluster(prefill, decodes) as url:
        events, ended_after, victim = streamed(url, decodes, "stalled")
        assert FAST["stall_timeout"] - 0.5 < ended_after < FAST["stall_timeout"] + 3
        assert "error" in json.loads(events[-1].removeprefix("data: "))
        assert healthy(url)[victim] is False
        decodes[int(victim[-1])].stalled = False
        assert until(lambda: healthy(url)[victim], timeout=5)


def test_workers_whose_snapshot_stands_still_but_whose_health_answers_stay_in():
    prefill = FakeWorker()
    decodes = [FreezableWorker(Behaviour(chunks=40, chunk_delay=0.1)) for _ in range(2)]
    with pd_cluster(prefill, decodes) as url:
        ejected = threading.Event()
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                if not all(healthy(url).values()):
                    ejected.set()
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with httpx.stream("POST", f"{url}/generate", json={"text": "slow", "stream": True}, timeout=30) as r:
                busy = int(r.headers["x-pdcluster-decode"][-1])
                # Neither publishes (a live idle SGLang looks so), and /health answers.
                decodes[0].quiet = decodes[1].quiet = True
                events = [line for line in r.iter_lines() if line.startswith("data:")]
        finally:
            done.set()
            watcher.join()
        assert events[-1] == "data: [DONE]"  # 4 s of streaming, more than twice the stall timeout
        assert busy in (0, 1)
        assert not ejected.is_set()


def test_a_prefill_silent_in_a_long_forward_pass_keeps_its_requests_and_a_stuck_one_is_ejected():
    """A prefill busy with one long prompt: its /health waits and its snapshot stands still for 4 s, over the 1.5 s
    stall timeout, but the prompt in flight (~500 tokens estimated, at the default 0.02 s a token, times SAFETY)
    allows ~31 s: the request is answered and nothing is ejected. Silent with only a short prompt in flight, it is
    ejected soon after its allowance (1.5 s + ~0.1 s). (A fake decode answers without KV, so the requests
    themselves succeed: the point is the verdict on the prefill.)"""
    prefill = FreezableWorker(Behaviour(delay=4.0))
    with pd_cluster(prefill, [FreezableWorker(Behaviour())]) as url:
        prefill.stalled = True  # the forward pass: /health waits, nothing is published
        assert httpx.post(f"{url}/generate", json={"text": "x" * 1000}, timeout=30).status_code == 200
        seen, started = [], time.monotonic()
        while time.monotonic() - started < 3.5:  # within the prefill's 4 s forward pass: nothing is ejected
            seen.append(healthy(url)["static-prefill-0"])
            time.sleep(0.2)
        assert all(seen), seen
        prefill.stalled = False  # the forward pass is over: SGLang publishes and answers /health again
        time.sleep(1.0)
        prefill.behaviour, prefill.stalled = Behaviour(hang=True), True  # stuck now: silent, and it never answers
        started = time.monotonic()
        httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30)
        assert until(lambda: not healthy(url)["static-prefill-0"], timeout=10)
        assert time.monotonic() - started < 6.0
        prefill.stalled = False
        assert until(lambda: healthy(url)["static-prefill-0"], timeout=5)


def test_time_the_router_itself_was_stalled_counts_against_no_worker():
    """A router whose event loop was blocked for 20 s (or that was SIGSTOPped) must not wake up and eject every
    worker, ending every request, for not having answered meanwhile."""
    clock = [100.0]
    answering = [True]

    async def handler(request: httpx.Request) -> httpx.Response:
        if not answering[0]:
            await asyncio.sleep(3600)
        return httpx.Response(200, json=snapshot(clock[0]))

    async def scenario() -> list[bool]:
        pool = WorkerPool()
        worker = Worker("d", Role.DECODE, "http://decode")
        pool.workers["d"] = worker
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            watch = LivenessWatch(CONFIG, pool, client, None, clock=lambda: clock[0])
            seen = []
            for step in (1.0, 1.0, 20.0, 1.0):  # the third tick comes 20 s late
                clock[0] += step
                watch.tick()  # the verdict, before this tick's probe could answer
                seen.append(worker.alive)
                await asyncio.sleep(0.05)  # the probes answer
            answering[0] = False  # now the worker stops answering: that is noticed as usual
            for _ in range(7):
                clock[0] += 1.0
                watch.tick()
                await asyncio.sleep(0.01)
            seen.append(worker.alive)
            for live in watch.states.values():
                live.task.cancel()
            return seen

    assert asyncio.run(scenario()) == [True, True, True, True, False]


def test_a_static_prefill_gets_the_forward_pass_its_config_gives():
    from router.config import StaticWorker

    listed = Worker.from_static(Role.PREFILL, StaticWorker(url="http://127.0.0.1:1", kv_bootstrap_port=2,
                                                           forward_tokens=4096), 0)
    assert silent_tokens(listed) == 4096
    unknown = Worker.from_static(Role.PREFILL, StaticWorker(url="http://127.0.0.1:1", kv_bootstrap_port=2), 0)
    unknown.pending_prompt_tokens = 12
    assert silent_tokens(unknown) == 12
