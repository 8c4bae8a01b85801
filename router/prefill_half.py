"""The prefill's half of an attempt. Its answer is only waited for (for its input logprobs), never relayed; what
matters is its status: the moment it fails, the decode's response is interrupted, since with no prefill no KV
will ever arrive. Once the decode has answered, it may trail by up to PREFILL_GRACE seconds."""

from __future__ import annotations

import asyncio

from router.failures import TRANSPORT_ERRORS, HalfFailed, status_failure, transport_failure
from router.upstream import ConnectionDropped, UpstreamClient, UpstreamResponse
from router.workers import Worker

PREFILL_GRACE = 30.0  # seconds a prefill's answer may trail the decode's before it is cut off


class PrefillHalf:
    """Sent at once on construction (raises one of TRANSPORT_ERRORS if it cannot be); `future` holds its answer."""

    def __init__(self, client: UpstreamClient, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                 prompt_tokens: int = 0):
        self.client, self.worker, self.path, self.body, self.headers = client, worker, path, body, headers
        self.failure: HalfFailed | None = None
        self._decode: UpstreamResponse | None = None  # the decode's response, to interrupt if this half fails
        self.future = self._start()
        self.prompt_tokens = prompt_tokens  # on the worker's books until the answer is in (router/liveness.py)
        worker.pending_prompt_tokens += prompt_tokens
        self.future.add_done_callback(self._done)

    def _start(self) -> asyncio.Future:
        """On a kept-alive connection the answer is followed by callbacks, not a task: a task costs the router ~5%
        of its CPU."""
        response = self.client.send_now("POST", self.worker.url, self.path, self.body, self.headers)
        if response is None:  # no idle connection: connecting takes a task
            return asyncio.create_task(self._send())
        outcome = asyncio.get_running_loop().create_future()

        def finished(r: UpstreamResponse) -> None:
            if outcome.done():
                return
            if r.error is None:
                try:
                    outcome.set_result(self._payload(r.status, r.body()))
                except HalfFailed as failure:
                    outcome.set_exception(failure)
            elif isinstance(r.error, ConnectionDropped) and r.error.before_response:
                # The worker had closed that kept-alive connection: resend on a new one.
                _follow(asyncio.create_task(self._send()), outcome)
            else:
                outcome.set_exception(transport_failure(self.worker, r.error))

        response.on_done = finished
        outcome.add_done_callback(lambda f: response.close() if f.cancelled() else None)
        return outcome

    async def _send(self) -> bytes:
        r = None
        try:
            r = await self.client.request("POST", self.worker.url, self.path, self.body, self.headers)
            payload = await r.read()
        except TRANSPORT_ERRORS as exc:
            raise transport_failure(self.worker, exc) from None
        finally:
            if r is not None:
                r.close()
        return self._payload(r.status, payload)

    def _payload(self, status: int, payload: bytes) -> bytes:
        if status >= 400:
            raise status_failure(self.worker, status, payload)
        return payload

    def watch(self, decode: UpstreamResponse) -> None:
        """Interrupt the decode's response with this half's failure, now or when it comes (the decode request's
        on_sent)."""
        self._decode = decode
        if self.failure is not None:
            decode.interrupt(self.failure)

    def _done(self, future: asyncio.Future) -> None:
        self.worker.pending_prompt_tokens -= self.prompt_tokens
        if not future.cancelled() and isinstance(future.exception(), HalfFailed):
            self.failure = future.exception()
            if self._decode is not None:
                self._decode.interrupt(self.failure)

    async def answer(self) -> bytes:
        """The prefill's own answer, which may trail the decode's by a moment."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.future), PREFILL_GRACE)
        except TimeoutError:
            raise HalfFailed(self.worker, 504, f"prefill {self.worker.worker_id} did not answer within "
                                               f"{PREFILL_GRACE:.0f}s of the decode") from None

    def let_finish(self, background: set) -> None:
        """The attempt is over: let the prefill's answer finish in `background`, within PREFILL_GRACE."""
        future = self.future
        if future.done():
            return
        background.add(future)
        cutoff = asyncio.get_running_loop().call_later(PREFILL_GRACE, future.cancel)

        def finished(f: asyncio.Future) -> None:
            cutoff.cancel()
            background.discard(f)
        future.add_done_callback(finished)


def _follow(task: asyncio.Task, outcome: asyncio.Future) -> None:
    """Settle `outcome` as `task` ends; cancelling `outcome` cancels `task`."""
    def settle(t: asyncio.Task) -> None:
        if outcome.done():
            return
        if t.cancelled():
            outcome.cancel()
        elif t.exception() is not None:
            outcome.set_exception(t.exception())
        else:
            outcome.set_result(t.result())
    task.add_done_callback(settle)
    outcome.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
