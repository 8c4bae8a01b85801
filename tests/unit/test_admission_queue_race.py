"""The router's admission queue (router/pd/gate.py) when a queued request's wait runs out in the same instant as its
turn comes: asyncio.timeout cancels the request's future at once, but the request leaves the queue only when its task
runs next; a queue served in between must pass it by. bench.overload met it on SmolLM2: the queue's server died on
`InvalidStateError` and the request was answered a bare 500 instead of its 429."""

from __future__ import annotations

import asyncio

from router.admission.gate import Refused
from router.config import PriorityClass
from tests.unit.test_admission_wait import admission, gate_on, prefill


def test_a_request_whose_wait_ran_out_as_its_turn_came_is_passed_by_and_nothing_stays_reserved():
    worker = prefill(pending=3000)  # 30 s at 100 tokens/s: over the bound, so requests queue
    gate = gate_on(worker, config=admission(default=PriorityClass(max_predicted_wait=20, queue_wait=5)))

    async def one() -> str:
        try:
            async with gate.admitted("default", 100):
                return "served"
        except Refused as refused:
            return refused.reason

    async def scenario() -> list:
        leaving, staying = asyncio.create_task(one()), asyncio.create_task(one())
        await asyncio.sleep(0.01)
        first = gate.queues["default"].head()
        leaving.cancel()  # as asyncio.timeout does at queue_wait: its future is cancelled now, its task runs later
        assert first is not None and first.future.cancelled()
        worker.pending_work_tokens = 0  # the prefill drained: both heads fit under the bound
        gate.admit_heads()  # before the cancelled request's task ran: it is passed by, the next one admitted
        return list(await asyncio.gather(leaving, staying, return_exceptions=True))

    leaving, staying = asyncio.run(scenario())
    assert isinstance(leaving, asyncio.CancelledError) and staying == "served"
    assert gate.reserved == 0 and not gate.queues["default"]
