"""The PD dispatcher: one attempt of a request on one pair (router/attempt.py owns it from start to end), and the
aborts that free a half's KV slots.

Both halves go through router/upstream.py, the data plane's own lean HTTP client (why: see that module). The same
body goes to the prefill and the decode at once; the client gets the decode's answer, relayed chunk by chunk if it
is a stream. Whichever half fails first, the other is aborted through SGLang's /abort_request right away, so no KV
slot waits out SGLang's own (300 s by default) timeouts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import orjson

from router.attempt import Attempt
from router.config import RouterConfig
from router.edge import Answer, StreamAnswer
from router.failures import TRANSPORT_ERRORS
from router.metrics import RouterMetrics
from router.request import PdRequest
from router.upstream import UpstreamClient
from router.workers import Worker

log = logging.getLogger("pdcluster.router")

_JSON = {"content-type": "application/json"}
_ABORT_TIMEOUT = 5.0  # seconds an /abort_request may take


class Dispatcher:
    def __init__(self, client: UpstreamClient, metrics: RouterMetrics, background: set[asyncio.Future],
                 config: RouterConfig):
        self.client, self.metrics, self.background, self.config = client, metrics, background, config

    async def forward(self, request: PdRequest, prefill: Worker, decode: Worker) -> Answer | StreamAnswer:
        """The current attempt of `request` on this pair. Raises HalfFailed if it fails before the answer starts."""
        return await Attempt(self, request, prefill, decode).answer()

    def abort(self, request: PdRequest, workers: Iterable[Worker]) -> None:
        """Free the KV slots of the current attempt on `workers` now, in the background (SGLang's /abort_request)."""
        for worker in workers:
            task = asyncio.create_task(self._abort(worker, request.rids, request.request_id))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def _abort(self, worker: Worker, rids: list[str], request_id: str) -> None:
        for rid in rids:
            self.metrics.aborts.labels(worker.role.value).inc()
            try:
                async with asyncio.timeout(_ABORT_TIMEOUT):
                    response = await self.client.request("POST", worker.url, "/abort_request",
                                                         orjson.dumps({"rid": rid}), _JSON)
                    await response.read()
                log.info("abort sent", extra={"request_id": request_id, "rid": rid, "role": worker.role.value,
                                              "worker": worker.url})
            except TRANSPORT_ERRORS as exc:
                log.warning("abort failed", extra={"request_id": request_id, "rid": rid, "worker": worker.url,
                                                   "error": repr(exc)})
