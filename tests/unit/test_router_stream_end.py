"""However a streamed answer ends, its pair is freed: both workers' in_flight back to 0, the halves that may still be
working on it aborted with the attempt's rid."""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack, suppress

import httpx
import pytest

from router.app import create_app
from router.config import RouterConfig
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.helpers import until
from tests.unit.test_router_pd import cluster


async def _eventually(predicate, timeout: float = 15.0) -> bool:
    """`until`, for a test that runs the router on its own event loop (the loop must keep turning meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.parametrize("how", ["cancelled while the headers drain", "send raises OSError"])
def test_a_client_that_leaves_right_after_the_headers_frees_the_pair(how):
    """The client reads the stream's headers and drops before the relay pulls its first chunk: as an ASGI server
    does it, either the send of the headers is still waiting for the socket to drain when the disconnect comes, or
    (ASGI 2.4) the send raises OSError. The relay never ran: it used to leave in_flight at +1 and abort nothing."""
    prefill, decode = FakeWorker(Behaviour(hang=True)), FakeWorker(Behaviour(first_chunk_delay=60))

    async def scenario(edge) -> tuple[list[int], dict]:
        left, started = asyncio.Event(), {}
        body = json.dumps({"text": "hi", "stream": True}).encode()
        inbox = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if inbox:
                return inbox.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
                left.set()  # the client has its headers, and goes
                if how == "send raises OSError":
                    raise OSError("the client closed the connection")
                await asyncio.Event().wait()  # the write waits on a socket nobody reads any more

        scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        pool = edge.app.state.pool
        async with edge.app.router.lifespan_context(edge.app):
            with suppress(OSError):  # the server's own error, passed back to it
                await asyncio.wait_for(edge(scope, receive, send), 30)
            await _eventually(lambda: prefill.aborted and decode.aborted)
            return [w.in_flight for w in pool.workers.values()], started

    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill.app()))
        d = stack.enter_context(ServerThread(decode.app()))
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                              decode=[{"url": d.url}], health_interval=60)
        in_flight, started = asyncio.run(scenario(create_app(config)))
    assert started["status"] == 200
    assert in_flight == [0, 0]
    assert prefill.aborted == decode.aborted == [decode.received[0]["rid"]]


def test_a_decode_that_stalls_mid_stream_past_read_timeout_is_aborted_with_its_prefill():
    """The decode may still be generating when the router gives up on it: both halves are aborted, as for
    first_byte_timeout, and the client's stream ends with an error event that names the limit."""
    # The prefill answers at once: one that hung would hit read_timeout first.
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=5, stall_after_chunks=2))
    with cluster(prefill, decode, read_timeout=1.0) as url:
        with httpx.stream("POST", f"{url}/generate", json={"text": "hi", "stream": True}, timeout=30) as response:
            events = [line for line in response.iter_lines() if line.startswith("data:")]
        assert until(lambda: prefill.aborted and decode.aborted)
    assert len(events) == 3
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == 504 and "read_timeout (1.0s)" in error["message"] and "decode" in error["message"]
    assert prefill.aborted == decode.aborted == [decode.received[0]["rid"]]
