"""Liveness through the whole router (router/fleet/liveness.py): fake workers that freeze like a SIGSTOPped SGLang, or
whose scheduler stalls while their HTTP side answers, are ejected, the requests open on them end (retried before
their first byte, an SSE error event after), and they are readmitted once they answer again. The verdict alone, on
a fake clock: test_liveness.py."""


from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
from fastapi import FastAPI, Request, Response

from pdcluster.common.protocol import Role
from router.app import create_app
from router.config import RouterConfig
from router.fleet.discovery import static_worker
from router.fleet.liveness import (
    LivenessWatch,
    silent_tokens,
)
from router.fleet.workers import Worker, WorkerPool
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.helpers import until

CONFIG = RouterConfig(liveness_interval=1.0, liveness_timeout=5.0, stall_timeout=6.0)


def snapshot(stamp: float) -> dict:
    return {"loads": [{"timestamp": stamp, "num_running_reqs": 1, "num_waiting_reqs": 0}]}

# ----- the router, with fake workers that freeze -----

class FreezableWorker(FakeWorker):
    """A fake SGLang worker with /v1/loads. `frozen`: nothing answers (a SIGSTOPped process tree); `stalled`: the
    HTTP side answers but the scheduler is stuck (no token, /health waits, the snapshot stands still); `quiet`:
    the snapshot stands still only (an idle SGLang publishes nothing); `draining`: /health refused at once (503, as
    SGLang's while it shuts down) and the snapshot still, while its streams go on."""

    def __init__(self, behaviour: Behaviour) -> None:
        super().__init__(behaviour)
        self.frozen = self.stalled = self.quiet = self.draining = False
        self.stamp = time.time()

    def app(self) -> FastAPI:
        app = super().app()

        @app.middleware("http")
        async def freeze(request: Request, call_next):
            while self.frozen or (self.stalled and request.url.path == "/health"):
                await asyncio.sleep(0.01)
            if self.draining and request.url.path == "/health":
                return Response(status_code=503)
            return await call_next(request)

        @app.get("/v1/loads")
        async def loads() -> dict:
            if not (self.stalled or self.quiet or self.draining):
                self.stamp = time.time()
            return {"loads": [{"timestamp": self.stamp, "num_running_reqs": 0, "num_waiting_reqs": 0}]}

        return app

    async def _stream(self, b: Behaviour, body: dict, path: str):
        async for chunk in super()._stream(b, body, path):
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
            d.frozen = d.stalled = d.quiet = d.draining = False




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
    # What is under test is the snapshot standing still (stall_timeout 1.5 s): a loaded machine's slow /v1/loads
    # answer (over FAST's 1 s) is another verdict, which ejected a worker here in a loaded run.
    with pd_cluster(prefill, decodes, liveness_timeout=3.0) as url:
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


def test_a_draining_decode_that_refuses_health_and_publishes_seldom_finishes_its_stream():
    """`docker stop` of a SmolLM2 decode mid-stream: SGLang answers /health 503 at once while it drains and publishes
    its snapshot every 15 steps. A refused probe is an answer, not a scheduler keeping /health waiting: the router
    used to eject it as stuck and cut the stream the drain was there to finish."""
    prefill = FakeWorker()
    decodes = [FreezableWorker(Behaviour(chunks=40, chunk_delay=0.1)) for _ in range(2)]
    with pd_cluster(prefill, decodes) as url:
        with httpx.stream("POST", f"{url}/generate", json={"text": "slow", "stream": True}, timeout=30) as r:
            busy = decodes[int(r.headers["x-pdcluster-decode"][-1])]
            busy.draining = True
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]", events[-2:]  # 4 s of streaming, more than twice the stall timeout
        assert len(events) == 41


def test_a_prefill_silent_in_a_long_forward_pass_keeps_its_requests_and_a_stuck_one_is_ejected():
    """A prefill busy with one long prompt: its /health waits and its snapshot stands still for 4 s, over the 1.5 s
    stall timeout, but the prompt in flight (~500 tokens estimated, at the default 0.02 s a token, times SAFETY)
    allows ~31 s: the request is answered and nothing is ejected. Silent with only a short prompt in flight, it is
    ejected soon after its allowance (1.5 s + ~0.1 s). (The fake decode answers after the prefill, as a real one
    whose KV comes from it; a delivered answer takes its prompt off the books.)"""
    prefill = FreezableWorker(Behaviour(delay=4.0))
    with pd_cluster(prefill, [FreezableWorker(Behaviour(delay=4.5))]) as url, ThreadPoolExecutor(1) as pool:
        prefill.stalled = True  # the forward pass: /health waits, nothing is published
        answer = pool.submit(httpx.post, f"{url}/generate", json={"text": "x" * 1000}, timeout=30)
        seen, started = [], time.monotonic()
        while time.monotonic() - started < 3.5:  # within the prefill's 4 s forward pass: nothing is ejected
            seen.append(healthy(url)["static-prefill-0"])
            time.sleep(0.2)
        assert answer.result().status_code == 200
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


def test_a_decode_silent_while_it_waits_for_its_prefills_kv_keeps_its_requests():
    """A decode whose requests wait for KV from a prefill still in its forward pass: SGLang's decode has its pool
    reserved for them, so /health waits and the snapshot stands still for 4 s, over the 1.5 s stall timeout. The
    prompt whose KV it awaits (~500 tokens) allows for it: nothing is ejected and the request is answered."""
    prefill, decode = FreezableWorker(Behaviour(delay=4.0)), FreezableWorker(Behaviour(delay=4.0))
    with pd_cluster(prefill, [decode]) as url:
        decode.stalled = True
        assert httpx.post(f"{url}/generate", json={"text": "x" * 1000}, timeout=30).status_code == 200
        decode.stalled = False
        assert healthy(url)["static-decode-0"]
        assert httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=30).status_code == 200


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

    spec = StaticWorker(url="http://127.0.0.1:1", kv_bootstrap_port=2, forward_tokens=4096)
    listed = static_worker(spec, Role.PREFILL, 0)
    assert silent_tokens(listed) == 4096
    unknown = static_worker(StaticWorker(url="http://127.0.0.1:1", kv_bootstrap_port=2), Role.PREFILL, 0)
    unknown.pending_prompt_tokens = 12
    assert silent_tokens(unknown) == 12
