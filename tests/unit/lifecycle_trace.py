"""The request docs/lifecycle.md walks, traced: a streamed POST /v1/chat/completions through the router's ASGI app
(router/app.py's create_app) with the shipped config (configs/router.yaml: its prefill policy is cache_aware), in
process, every Python call profiled; the files of router/ it ran code in are what tests/unit/test_lifecycle_doc.py
holds the page to.

The cluster is fakes in this process: two prefills (so cache_aware has a choice) and a decode (tests/fakes.py), each
prefill publishing KV events (tests/unit/kv_event_fakes.py), the workers registered with the demo model
(models/tiny-llama), whose tokenizer and chat template the router reads, as under `make up`. The second prefill holds
the first pages of the chat's system message, so the request goes the indexed path, not the blind fallback, and the
test checks it did: that prefill got it, and the router counted an indexed decision that predicted those pages.

What the router runs beside the request (its probes, the KV event subscriptions) is left out: calls made in a task
that was running before the request came are not the request's."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
SYSTEM = "You are the tenant's assistant: answer from the terms of their plan, briefly and politely. " * 3
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which plan am I on?"}]
CHUNK = 16  # tokens: the index matches a prompt by whole chunks of pages (router/kv_routing/kv_keys.py's CHUNK)
READY_WITHIN = 15.0  # seconds for the index to hear the prefills and the router to load the model's tokenizer


def system_prefix_ids(model: Path) -> list[int]:
    """The leading ids of any chat that opens with SYSTEM, as the model's chat template and tokenizer make them (what
    a prefill that served such a chat holds), less a few at the end that the next message may merge with."""
    import jinja2
    from tokenizers import Tokenizer

    special = json.loads((model / "tokenizer_config.json").read_text())
    template = jinja2.Template((model / "chat_template.jinja").read_text())
    text = template.render(messages=MESSAGES[:1], add_generation_prompt=False, bos_token=special["bos_token"])
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    return ids[:(len(ids) - 4) // CHUNK * CHUNK]


def files_a_streamed_chat_runs(model: Path) -> set[str]:
    from pdcluster.common.config_file import load_yaml
    from pdcluster.common.protocol import ModelIdentity
    from router.app import create_app
    from router.config import RouterConfig
    from tests.fakes import Behaviour, FakeWorker
    from tests.unit.kv_event_fakes import PAGE, FakePublisher, served_pool, stored

    held = system_prefix_ids(model)
    assert len(held) >= 2 * CHUNK, "the system message is a few chunks long"
    identity = ModelIdentity(model_path=str(model), served_model_name="tiny-llama", page_size=PAGE,
                             kv_cache_dtype="auto", transfer_backend="mooncake")
    prefills, publishers = [FakeWorker(), FakeWorker()], [FakePublisher(), FakePublisher()]
    decode = FakeWorker(Behaviour(cached_tokens=len(held)))  # its usage reports the prefix as cached
    publishers[0].publish(0, [stored([1], [7] * PAGE)], live=False)  # heard of, holding nothing of the chat
    publishers[1].publish(0, [stored(list(range(1, len(held) // PAGE + 1)), held)], live=False)  # its first pages
    # The shipped config, but for the registry (the workers are given) and what would run beside the request: probes
    # (an in-flight worker is probed every health_interval) and the admission canaries.
    shipped = load_yaml(ROOT / "configs" / "router.yaml")
    config = RouterConfig.model_validate({**shipped, "bootstrap_url": None, "health_interval": 60,
                                          "liveness_interval": 60, "admission_check": False})
    assert config.prefill_policy == "cache_aware", "the page walks the shipped prefill policy"
    with ExitStack() as stack:
        pool = served_pool(stack, prefills, decode, publishers, identity)
        ran, counted = asyncio.run(_traced(create_app(config, pool)))
    assert counted == {"indexed": 1, "predicted": len(held)}, "the chat was routed by the KV index, to its prefix"
    got = [[body for body in worker.received if body.get("messages") == MESSAGES] for worker in prefills]
    assert [len(bodies) for bodies in got] == [0, 1], "the chat went to the prefill holding its prefix"
    return ran


async def _traced(edge: Any) -> tuple[set[str], dict[str, float]]:
    """The files of router/ the streamed chat ran code in; what the router counted of it: its decisions by the KV
    index, and the cached tokens they predicted."""
    registry, ran, router = edge.app.state.metrics.registry, set(), str(ROOT / "router")
    beside: set[asyncio.Task] = set()  # the router's own tasks, running before the request came

    def decisions() -> float:
        return registry.get_sample_value("pdcluster_router_routing_decisions_total", {"kind": "indexed"}) or 0.0

    def predicted() -> float:
        return registry.get_sample_value("pdcluster_router_kv_prediction_tokens_total", {"kind": "predicted"}) or 0.0

    def profile(frame, event, _arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(router) and asyncio.current_task() not in beside:
            ran.add(str(Path(frame.f_code.co_filename).relative_to(ROOT)))

    async with edge.app.router.lifespan_context(edge.app):
        # Other chats until one is routed by the index: it heard both prefills, and the tokenizer is loaded. (Their
        # first chunk is not the traced chat's: nothing they leave is held to count for it.)
        until = time.monotonic() + READY_WITHIN
        while not decisions():
            assert time.monotonic() < until, "the router never routed a chat by its KV index"
            await _post(edge, {"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 2})
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # what those left in the background
        before = decisions(), predicted()
        beside.update(asyncio.all_tasks() - {asyncio.current_task()})
        sys.setprofile(profile)
        try:
            sent = await _post(edge, {"model": "tiny-llama", "messages": MESSAGES, "stream": True,
                                      "stream_options": {"include_usage": True}})
            await asyncio.sleep(0.2)  # what the attempt left in the background
        finally:
            sys.setprofile(None)
    assert sent[0]["status"] == 200 and b"data: [DONE]" in b"".join(m.get("body", b"") for m in sent[1:]), sent
    return ran, {"indexed": decisions() - before[0], "predicted": predicted() - before[1]}


async def _post(edge: Any, body: dict) -> list[dict]:
    """One POST of the chat through the edge, as uvicorn makes it; the messages sent back."""
    inbox = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []
    over = asyncio.Event()

    async def receive() -> dict:
        if inbox:
            return inbox.pop()
        await over.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [(b"content-type", b"application/json")]}
    try:
        await edge(scope, receive, send)
    finally:
        over.set()
    return sent
