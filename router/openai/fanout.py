"""OpenAI's `n`: n choices of one prompt are n PD requests of it, merged into the one answer the client asked for.

Each choice is a request of its own (its own rooms and rids, its attempts and retries: PdService.serve), made as the
client's with `n` left out. The client gets one answer: one id, the choices indexed as OpenAI indexes them (a list of
k prompts: prompt * n + choice), the usage of the prompt once and of every choice's completion. Streamed: every
choice's events as they come, their index, id and time rewritten, then one usage event (if any choice sent one) and
one `data: [DONE]`. One choice failing fails the answer: the others are cancelled, which ends their attempts as a
client that left does (both halves aborted), and the client gets that choice's error: the JSON error, or, once the
stream has started, a last error event (as any stream that breaks ends).

The order, and the prefill: the first choice goes alone; the others start once its prefill is chosen, to that same
prefill, and their prefill halves are held until the first's has answered (each choice's FanOutOptions,
router/pd/fan_out_options.py). SGLang's prefill puts a prompt's KV into its radix cache only once the prompt is
prefilled and sent (the transfer done), which is when that half answers: identical prompts sent together are each
prefilled from scratch (n times the prompt's compute and KV), and another prefill has no copy. So n = 4 on a 1000-token
prompt computes its KV once, plus a token for each later choice, and sends it four times. Their decode halves go at
once: the decode's handshake with the prefill (SGLang takes a decode's before its prefill's) is done while the first is
prefilled, not after, between the first's decode steps. If the first choice ends before its prefill half answers (a
short answer), the others' prefill halves go then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json  # as SGLang wrote the answers: logprobs may be -Infinity, which json reads and writes back, orjson not
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

from pdcluster.common.http import ApiError, error_body
from router.config import RouterConfig
from router.fleet.workers import Worker
from router.metrics import RouterMetrics
from router.openai.openai_answer import dumps, merged_answer, merged_event, merged_usage
from router.pd.fan_out_options import FanOutOptions
from router.pd.request import PdRequest, new_rid
from router.transport.edge import Answer, StreamAnswer, error_answer
from router.transport.upstream_response import sse_events

log = logging.getLogger("pdcluster.router")

Serve = Callable[[PdRequest, FanOutOptions], Awaitable[Answer | StreamAnswer]]
SEEDS = 2**63  # a seed is below (the inventory's Seed)
QUEUED = 64  # events of the choices held for a client that reads slower than they come; then their relays wait
_FAILED = "the router failed on this request (its log has the details)"


async def answer(request: PdRequest, serve: Serve, config: RouterConfig,
                 metrics: RouterMetrics) -> Answer | StreamAnswer:
    """The answer of a request for `n` > 1 choices; a 400 naming `n` over the router's max_n."""
    n = request.checked.choices
    if n > config.max_n:
        raise ApiError(400, f"n is {n}; this router serves at most {config.max_n} choices per request (max_n)", "n")
    if log.isEnabledFor(logging.INFO):
        log.info("fan-out", extra={"request_id": request.request_id, "route": request.route, "choices": n})
    fan = FanOut(request, serve, metrics)
    return await fan.streamed() if request.stream else await fan.whole()


def choice_request(request: PdRequest, index: int) -> PdRequest:
    """Choice `index` of the request: its body without `n`; a seed made the choice's own (the same seed would make
    the same choice n times; the first keeps the client's, so that n = 1 and the first choice agree)."""
    body = {key: value for key, value in request.body.items() if key != "n"}
    if index and isinstance(seed := body.get("seed"), int):
        body["seed"] = (seed + index) % SEEDS
    return PdRequest(request.route, request.request_id, body, request.checked, request.started,
                     request.deadline - request.started)


class FanOut:
    def __init__(self, request: PdRequest, serve: Serve, metrics: RouterMetrics):
        self.request, self.serve, self.metrics = request, serve, metrics
        self.n = request.checked.choices
        self.choices = [choice_request(request, i) for i in range(self.n)]
        loop = asyncio.get_running_loop()
        self.paired: asyncio.Future[None] = loop.create_future()  # the later choices are started
        self.go: asyncio.Future[None] = loop.create_future()  # the later choices' prefill halves may go
        # How each choice is served apart from a lone request (each timed only as part of the fan-out's answer): the
        # first tells when it is paired, the later ones wait at the gate.
        self.options = [FanOutOptions(on_paired=self._paired), *(FanOutOptions(prefill_gate=self.go)
                                                                   for _ in range(self.n - 1))]
        self.serving: list[asyncio.Future] = []  # each choice's PdService.serve, as it is started
        self.tasks: list[asyncio.Future] = []  # a stream's: each choice's relay to the merge, the later ones' start
        self.id, self.created = new_rid(), int(time.time())
        self.timed = False

    def _paired(self, prefill: Worker, future: asyncio.Future) -> None:
        """An attempt of the first choice sent its prefill half (`future`): the first such starts the later choices,
        to that prefill. Whichever half answers (a failed one is retried) holds the prompt: the gate opens."""
        future.add_done_callback(self._prefilled)
        if not self.paired.done():
            for later in self.options[1:]:
                later.prefer_prefill = prefill.worker_id
            self._start_later()

    def _prefilled(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._open()

    def _open(self) -> None:
        """The later choices' prefill halves may go (started, if the first ended before it was paired)."""
        if not self.go.done():
            self.go.set_result(None)
        if not self.paired.done():
            self._start_later()

    def _start(self, indices: range) -> list[asyncio.Future]:
        started: list[asyncio.Future] = [asyncio.ensure_future(self.serve(self.choices[i], self.options[i]))
                                         for i in indices]
        self.serving += started
        return started

    def _start_later(self) -> list[asyncio.Future]:
        """The choices after the first, each with the first's checks (its prompt counted, if it was)."""
        for later in self.choices[1:]:
            later.checked = self.choices[0].checked
        self.paired.set_result(None)
        return self._start(range(1, self.n))

    def _cancel(self) -> None:
        """Cancel what still runs, and end every stream a choice started: each attempt cancelled or ended early
        aborts both of its halves (a stream relayed to its end is delivered: ending it again does nothing)."""
        for task in (*self.tasks, *self.serving):
            task.cancel()
        for served in self.serving:
            answer = served.result() if served.done() and not served.cancelled() and not served.exception() else None
            if isinstance(answer, StreamAnswer):
                answer.close()

    async def _stop(self) -> None:
        self._cancel()
        await asyncio.gather(*self.tasks, *self.serving, return_exceptions=True)

    # --- a whole answer ----------------------------------------------------------------------------------------------

    async def whole(self) -> Answer:
        (first,) = self._start(range(1))
        finished: set[asyncio.Future] = set()
        try:
            while len(finished) < self.n:  # the later choices join `serving` once the first is paired
                waited = set(self.serving) - finished | ({self.paired} if not self.paired.done() else set())
                done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {self.paired}:
                    finished.add(task)
                    if (failed := _failed(task)) is not None:
                        return failed  # and the others are cancelled, below
                    if task is first:
                        self._open()
        finally:
            await self._stop()
        answers = [task.result() for task in self.serving]
        try:
            body = merged_answer([answer.body for answer in answers], self.n, self.id)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("choices not merged", extra={"request_id": self.request.request_id, "error": repr(exc)})
            return error_answer(502, "a decode answered with no OpenAI choices to merge")
        return Answer(answers[0].status, body, answers[0].headers)

    # --- a stream ----------------------------------------------------------------------------------------------------

    async def streamed(self) -> Answer | StreamAnswer:
        """The first choice's answer starts the client's: its failure before it started is the client's answer."""
        (started,) = self._start(range(1))
        first = await started
        if isinstance(first, Answer):
            return first
        queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue(QUEUED)
        self.tasks = [asyncio.ensure_future(self._relay(0, first, queue)), asyncio.ensure_future(self._later(queue))]
        return StreamAnswer(first.status, self._merged(queue), first.headers, self._close)

    async def _later(self, queue: asyncio.Queue) -> None:
        if not self.paired.done():  # the first's stream started: it was paired (a safeguard)
            self._start_later()
        await asyncio.gather(*(self._choice(index, task, queue) for index, task in enumerate(self.serving[1:], 1)))

    async def _choice(self, index: int, started: asyncio.Future, queue: asyncio.Queue) -> None:
        try:
            answer = await started
        except ApiError as exc:  # no pair, a prompt too long for the pair: as a request's answer would say
            answer = error_answer(exc.status, exc.message, exc.param)
        except Exception:
            log.exception("a choice failed", extra={"request_id": self.request.request_id})
            answer = error_answer(500, _FAILED)
        if isinstance(answer, StreamAnswer):
            await self._relay(index, answer, queue)
        else:  # failed before its stream started: the client's stream ends with its error
            self.metrics.stream_errors.labels(self.request.route).inc()
            await queue.put((index, b"data: " + answer.body + b"\n\n"))

    async def _relay(self, index: int, answer: StreamAnswer, queue: asyncio.Queue) -> None:
        """One choice's stream into the queue, event by event, then None; closed however it ends."""
        events = sse_events(answer.chunks)
        try:
            async for event in events:
                await queue.put((index, event))
        except Exception:
            log.exception("a choice's stream failed", extra={"request_id": self.request.request_id})
            self.metrics.stream_errors.labels(self.request.route).inc()
            await queue.put((index, f"data: {json.dumps(error_body(500, _FAILED))}\n\n".encode()))
        finally:
            await events.aclose()
            with contextlib.suppress(Exception):  # as the edge ends a stream (router/transport/edge.py's _end_stream)
                await answer.chunks.aclose()
            answer.close()
        await queue.put((index, None))

    async def _merged(self, queue: asyncio.Queue) -> AsyncGenerator[bytes, None]:
        over, first = 0, True
        usages: dict[int, tuple[dict, dict]] = {}
        try:
            while over < self.n:
                index, event = await queue.get()
                if event is None:
                    over += 1
                    if index == 0:  # the first ended (well), maybe before its prefill half answered
                        self._open()
                    continue
                out = merged_event(event, index, self.n, self.id, self.created, usages)
                if out is None:
                    continue
                if first:
                    first = False
                    self.metrics.first_token(self.request.route, time.monotonic() - self.choices[0].attempt_started)
                yield out
                if out.startswith(b'data: {"error"'):
                    return  # the others are cancelled, below
            if usages:
                usage = dict(usages[min(usages)][0])
                usage["id"], usage["created"] = self.id, self.created
                usage["usage"] = merged_usage([u for _, (_, u) in sorted(usages.items())])
                yield b"data: " + dumps(usage) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            await self._stop()

    def _close(self) -> None:
        """The edge is done with the stream, however it ended (also before its first chunk was pulled)."""
        self._cancel()
        if not self.timed:
            self.timed = True
            self.metrics.latency.labels(self.request.route).observe(time.monotonic() - self.request.started)


def _failed(task: asyncio.Future) -> Answer | None:
    """A choice's error answer, if it failed (a 4xx the router decided is raised, as the request's own would be)."""
    error = task.exception()
    if error is not None:
        raise error
    answer = task.result()
    return answer if isinstance(answer, Answer) and answer.status >= 400 else None
