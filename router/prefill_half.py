"""The prefill's half of an attempt. Its answer is only waited for (for its input logprobs), never relayed; what
matters is its status: the moment it fails, the decode's response is interrupted, since with no prefill no KV
will ever arrive. Once the decode has answered, it may trail by up to PREFILL_GRACE seconds."""

from __future__ import annotations

import asyncio

from router.failures import TRANSPORT_ERRORS, HalfFailed, status_failure, transport_failure
from router.upstream import UpstreamClient, UpstreamResponse
from router.workers import Worker

PREFILL_GRACE = 30.0  # seconds a prefill's answer may trail the decode's before it is cut off


class PrefillHalf:
    """Sent on construction, by a task; `future` holds its answer (or its HalfFailed). While the answer is
    outstanding, its prompt tokens are on the worker's books (router/liveness.py judges a silent worker by them)."""

    def __init__(self, client: UpstreamClient, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                 prompt_tokens: int = 0):
        self.client, self.worker, self.path, self.body, self.headers = client, worker, path, body, headers
        self.failure: HalfFailed | None = None
        self._decode: UpstreamResponse | None = None  # the decode's response, to interrupt if this half fails
        self.prompt_tokens = prompt_tokens
        worker.pending_prompt_tokens += prompt_tokens
        self.future: asyncio.Future = asyncio.ensure_future(self._send())
        self.future.add_done_callback(self._done)

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
        if r.status >= 400:
            raise status_failure(self.worker, r.status, payload)
        return payload

    def watch(self, decode: UpstreamResponse) -> None:
        """Interrupt the decode's response with this half's failure, now or when it comes (the decode request's
        on_sent)."""
        self._decode = decode
        if self.failure is not None:
            decode.interrupt(self.failure)

    def _done(self, future: asyncio.Future) -> None:
        self.worker.pending_prompt_tokens -= self.prompt_tokens
        if not future.cancelled() and isinstance(error := future.exception(), HalfFailed):
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
