"""The prefill's half of an attempt (router/pd/attempt.py): its prompt booked on both workers of the pair until the KV
is sent (the tokens the prefill will compute: the prefill policy's count in the pair's `Choice`, else the estimate);
sent at once, or, for a fan-out's later choice, once its gate opens (router/pd/fan_out_options.py); its answer let
finish within PREFILL_GRACE of the decode's.
"""

from __future__ import annotations

import asyncio
import time

from router.admission.queue_wait import record_prefill
from router.pd import failures
from router.pd.failures import TRANSPORT_ERRORS, HalfFailed
from router.pd.fan_out_options import FanOutOptions
from router.pd.request import PdRequest
from router.routing.policy import Choice
from router.transport.upstream import UpstreamClient, UpstreamResponse

PREFILL_GRACE = 30.0  # seconds a prefill's answer may trail the decode's before it is cut off


class PrefillHalf:
    """The prefill's half, sent by a task; `future` holds its answer (or its HalfFailed), never relayed (waited for
    its input logprobs only). Failed, it interrupts the decode's response (no KV will come). It may trail it."""

    def __init__(self, client: UpstreamClient, request: PdRequest, choice: Choice, body: bytes,
                 fanned: FanOutOptions | None):
        self.client, self.worker, self.body, self.request = client, choice.prefill, body, request
        self.failure: HalfFailed | None = None
        self.sent = False  # held at a fan-out's gate until its prompt is cached, else sent at once
        self.sent_at = 0.0
        self._decode: UpstreamResponse | None = None  # the decode's response, to interrupt if this half fails
        self.prompt_tokens = request.checked.prompt_tokens
        self.books = [choice.prefill, choice.decode]  # unbook() empties it
        self.work = self.prompt_tokens if choice.prefill_work is None else choice.prefill_work  # cache_aware's
        for booked in self.books:
            booked.book(self.prompt_tokens, self.work)
        self.future: asyncio.Future = asyncio.ensure_future(self._send(fanned.prefill_gate if fanned else None))
        self.future.add_done_callback(self._done)
        if fanned is not None and fanned.on_paired is not None:  # a fan-out's first choice (router/openai/fanout.py)
            fanned.on_paired(self.worker, self.future)

    async def _send(self, gate: asyncio.Future | None) -> bytes:
        if gate is not None:  # a fan-out's later choice: sent once its prompt is cached
            await asyncio.shield(gate)  # meanwhile its decode half's handshake is done
        self.sent, self.sent_at, r = True, time.monotonic(), None
        try:
            r = await self.client.request("POST", self.worker.url, self.request.route, self.body, self.request.headers)
            payload = await r.read()
        except TRANSPORT_ERRORS as exc:
            raise failures.transport_failure(self.worker, exc) from None
        finally:
            if r is not None:
                r.close()
        if r.status < 400 and b"abort" not in payload and b'"error"' not in payload:
            return payload  # the common case, decided here: failures.py is for failures
        return failures.prefill_answer(self.worker, r.status, payload)

    def watch(self, decode: UpstreamResponse) -> None:
        """Interrupt the decode's response with this half's failure, now or when it comes (the decode's on_sent)."""
        self._decode = decode
        if self.failure is not None:
            decode.interrupt(self.failure)

    def unbook(self) -> None:
        """The prompt off both workers' books (liveness, cache_aware), once: at this half's answer or the decode's."""
        for booked in self.books:
            booked.book(-self.prompt_tokens, -self.work)
        self.books.clear()

    def _done(self, future: asyncio.Future) -> None:
        self.unbook()
        if future.cancelled():
            return
        if (error := future.exception()) is None:  # answered: the prefill's rate, measured (admission/queue_wait.py)
            record_prefill(self.worker, self.work, self.sent_at, time.monotonic())
        elif isinstance(error, HalfFailed):
            self.failure = error
            if self._decode is not None:
                self._decode.interrupt(self.failure)

    async def answer(self) -> bytes:
        """The prefill's own answer, which may trail the decode's by a moment."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.future), PREFILL_GRACE)
        except TimeoutError:
            raise HalfFailed(self.worker, 504, f"prefill {self.worker.worker_id} did not answer within "
                                               f"{PREFILL_GRACE:.0f}s of the decode") from None

    def let_finish(self, background: set, delivered: bool) -> None:
        """The attempt is over: let the prefill's answer finish in `background`, within PREFILL_GRACE (a half held at
        a fan-out's gate, of an attempt that failed, is never sent)."""
        if delivered:
            self.unbook()
        if (future := self.future).done() or (not self.sent and not delivered and future.cancel()):  # at a gate
            return
        background.add(future)
        cutoff = asyncio.get_running_loop().call_later(PREFILL_GRACE, future.cancel)

        def finished(f: asyncio.Future) -> None:
            cutoff.cancel()
            background.discard(f)
        future.add_done_callback(finished)
