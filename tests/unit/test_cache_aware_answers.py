"""The cache_aware policy in a running router over fake workers: a router that cannot read the model's folder (compose,
Kubernetes) gets a prompt's ids from a worker's own /tokenize, routes by them, and says per answer what it predicted
the prefill held, against what the answer reports cached."""

from __future__ import annotations

import asyncio
import logging
from contextlib import ExitStack

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.common.protocol import ModelIdentity
from router.app import create_app
from router.checks.checked import Checked
from router.config import RouterConfig
from router.kv_routing.prompt_ids import BOUNDARY_TOKENS, MAX_CHARS, PromptTokens
from router.routing.policy import RoutingView
from router.transport.upstream import UpstreamClient
from tests.fakes import Behaviour, FakeWorker, ServerThread, fake_ids
from tests.helpers import until
from tests.unit.kv_event_fakes import PAGE, FakePublisher, served_pool, stored

HUB_MODEL = "some-org/not-a-folder-here"  # what compose's GPU workers register: a hub id the router cannot read
IDENTITY = ModelIdentity(model_path=HUB_MODEL, served_model_name="m", page_size=PAGE, kv_cache_dtype="auto",
                         transfer_backend="mooncake")
PROMPT = "You are the tenant's assistant; " * 4  # 128 characters: 64 of the fake's tokens, 16 pages


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_router_without_the_model_routes_by_a_workers_tokenizer_and_reports_its_prediction():
    prefills = [FakeWorker(), FakeWorker()]
    decode = FakeWorker(Behaviour(answer_fields={"meta_info": {"cached_tokens": 40}}))
    publishers = [FakePublisher(), FakePublisher()]
    ids = fake_ids(PROMPT)
    # p1 holds the prompt's first 12 pages; buffered, so the router's first replay brings them.
    publishers[1].publish(0, [stored(list(range(1, 13)), ids[:12 * PAGE])], live=False)
    with ExitStack() as stack:
        pool = served_pool(stack, prefills, decode, publishers, IDENTITY)
        config = RouterConfig(bootstrap_url=None, prefill_policy="cache_aware", expose_worker_ids=True,
                              health_interval=60, liveness_interval=60, admission_check=False)
        router = stack.enter_context(ServerThread(create_app(config, pool)))

        indexed: list[httpx.Response] = []

        def predicted() -> bool:  # until the index and the tokenizer's fallback are ready
            answer = httpx.post(f"{router.url}/generate", json={"text": PROMPT + "Which plan am I on?"})
            assert answer.status_code == 200, answer.text
            if "x-pdcluster-cached-tokens-predicted" in answer.headers:
                indexed.append(answer)  # the first decision by the index (a repeat would count the first as sent)
            return bool(indexed)

        assert until(predicted, 15, 0.1)
        answer = indexed[0]
        # SGLang reuses whole pages of all but a prompt's last token: the 12 pages held are all usable here.
        assert answer.headers["x-pdcluster-prefill"] == "p1"
        assert answer.headers["x-pdcluster-cached-tokens-predicted"] == str(12 * PAGE)
        asked = [body for p in prefills for body in p.tokenized]
        assert asked and asked[-1] == {"prompt": PROMPT + "Which plan am I on?"}
        metrics = samples(router.url)
    # The indexed answer: 48 predicted and 40 reported, so the index over-claimed 8 tokens.
    assert metrics[("pdcluster_router_kv_prediction_tokens_total", (("kind", "predicted"),))] == 48
    assert metrics[("pdcluster_router_kv_prediction_tokens_total", (("kind", "actual"),))] == 40
    assert metrics[("pdcluster_router_kv_prediction_miss_tokens_count", ())] == 1
    assert metrics[("pdcluster_router_kv_prediction_miss_tokens_bucket", (("le", "0.0"),))] == 0
    assert metrics[("pdcluster_router_kv_prediction_miss_tokens_bucket", (("le", "16.0"),))] == 1


def ask(worker: FakeWorker, *requests: RoutingView) -> list[list[int] | None]:
    """What one PromptTokens gets for each request from the worker's /tokenize."""
    async def run(url: str) -> list[list[int] | None]:
        client, tokens = UpstreamClient(5.0, 5.0), PromptTokens()
        try:
            return [await tokens.ask(client, url, request) for request in requests]
        finally:
            await client.close()

    with ServerThread(worker.app()) as server:
        return asyncio.run(run(server.url))


def test_a_workers_tokenize_is_asked_what_the_engine_renders_and_a_long_text_is_cut():
    worker = FakeWorker()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hello there"}], "tools": tools, "max_tokens": 5}
    chat = RoutingView("/v1/chat/completions", body, Checked(None, False, "hello there"))
    text = "ab" * MAX_CHARS
    long = RoutingView("/generate", {"text": text}, Checked(None, False, text))
    assert ask(worker, chat, long) == [[0, 1, 2, 3, *fake_ids("hello there")],
                                       fake_ids(text[:MAX_CHARS])[:-BOUNDARY_TOKENS]]  # a longer text may merge the cut
    assert worker.tokenized == [{"messages": body["messages"], "tools": tools},  # as SGLang's chat renders it
                                {"prompt": text[:MAX_CHARS]}]


def test_a_failing_tokenize_leaves_the_request_to_its_text_and_is_logged_once(caplog):
    request = RoutingView("/generate", {"text": "hi"}, Checked(None, False, "hi"))
    with caplog.at_level(logging.WARNING, logger="pdcluster.router"):
        assert ask(FakeWorker(tokenize_status=500), request, request) == [None, None]
    assert len([r for r in caplog.records if "/tokenize failed" in r.getMessage()]) == 1
