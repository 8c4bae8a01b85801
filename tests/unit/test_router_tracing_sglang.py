"""What the router sends is what SGLang 0.5.23's tracing needs, checked against SGLang's own code (no server): the
`traceparent` header of each leg makes SGLang's spans of that request, in its HTTP process and in its scheduler's,
children of the leg; the attempt names the bootstrap room as SGLang's spans do; a /health probe's unsampled
`traceparent` keeps SGLang from tracing the generation it runs for it. tests/e2e/test_tracing.py checks the same on
a real cluster.

SGLang's path, read in its source: tokenizer_manager._init_req_state takes `traceparent`/`tracestate` from the HTTP
request's headers (observability/trace.py extract_trace_headers) into a TraceReqContext (module "request"), whose
root span's parent they are; the scheduler gets a pickled copy and parents its spans on that root.
"""

from __future__ import annotations

import asyncio
import pickle

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.datastructures import Headers

from pdcluster.common.protocol import Role
from router.config import RouterConfig, StaticWorker
from router.fleet import health
from router.fleet.discovery import static_worker
from router.tracing.request_trace import sglang_room
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_router_pd import cluster
from tests.unit.test_router_tracing import finished, spans  # noqa: F401 - the fixture, shared by import


@pytest.fixture
def sglang(monkeypatch: pytest.MonkeyPatch):
    """SGLang's tracing module as `--enable-trace --trace-modules request,mooncake` leaves it in each of its
    processes (process_tracing_init), its spans landing in memory; the global provider is left alone."""
    from sglang.srt.observability import trace as sglang_trace

    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)  # SGLang's provider: the SDK's default, parent-based
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "prefill"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(sglang_trace, "tracer", provider.get_tracer("sglang server"))
    monkeypatch.setattr(sglang_trace, "opentelemetry_initialized", True)
    monkeypatch.setattr(sglang_trace, "global_trace_modules", ["request", "mooncake"])
    monkeypatch.setattr(sglang_trace, "threads_info", {})
    yield sglang_trace, exporter
    provider.shutdown()


def sglang_request(sglang_trace, headers: dict[str, str], role: str, rid: str, room: int) -> None:
    """One request through SGLang's tracing as its HTTP process and its scheduler trace it."""
    context = sglang_trace.TraceReqContext(
        rid, bootstrap_room=room, role=role, module_name="request",
        external_trace_header=sglang_trace.extract_trace_headers(Headers(headers=headers)))
    context.trace_req_start()
    context.trace_slice_start("tokenize", 1)
    context.trace_slice_end("tokenize", 1)
    scheduler = pickle.loads(pickle.dumps(context))  # what crosses to the scheduler process
    scheduler.rebuild_thread_context()
    scheduler.trace_slice_start(f"{role}_forward", 1)
    scheduler.trace_slice_end(f"{role}_forward", 1, thread_finish_flag=True)
    context.trace_req_finish()


def chain_ends_at(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> int | None:
    """The span id the parent chain of `span` leaves SGLang's spans at (a parent not among them)."""
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
    return None if span.parent is None else span.parent.span_id


@pytest.mark.parametrize("stream", [False, True])
def test_sglangs_spans_of_each_half_nest_under_the_routers_leg(spans, sglang, stream):  # noqa: F811
    sglang_trace, sglang_spans = sglang
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=2))
    with cluster(prefill, decode, tracing=True) as url:
        assert httpx.post(f"{url}/generate", json={"text": "hi", "stream": stream}).status_code == 200
        by_name = finished(spans, 4)
    (attempt,) = by_name["attempt"]
    body = decode.received[0]
    for role, worker in (("prefill", prefill), ("decode", decode)):
        sglang_spans.clear()
        sglang_request(sglang_trace, worker.received_headers[0], role, body["rid"], body["bootstrap_room"])
        made = sglang_spans.get_finished_spans()
        (leg,) = by_name[role]
        (root,) = [s for s in made if s.name == f"{role} Req {body['rid'][:8]}"]
        assert len(made) >= 5  # the root, two thread spans (HTTP process, scheduler), a stage in each
        assert {s.context.trace_id for s in made} == {leg.context.trace_id}
        by_id = {s.context.span_id: s for s in made}
        assert {chain_ends_at(s, by_id) for s in made} == {leg.context.span_id}, role
        assert root.parent.span_id == leg.context.span_id
        # One value finds the attempt, both halves' roots and the prefill's KV transfer (a trace of SGLang's own)
        assert root.attributes["bootstrap_room"] == attempt.attributes["bootstrap_room"] == hex(body["bootstrap_room"])


def test_a_batchs_rooms_are_written_as_sglang_writes_each_items():
    assert sglang_room(255) == "0xff"
    assert sglang_room([1, 4096]) == ["0x1", "0x1000"]


def probe_headers(traced: bool) -> list[httpx.Headers]:
    """The headers of two /health probes of one worker."""
    seen: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200)

    worker = static_worker(StaticWorker(url="http://decode:1"), Role.DECODE, 0)

    async def probe_twice() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for _ in range(2):
                await health.probe(worker, client, RouterConfig(bootstrap_url=None), traced=traced)

    asyncio.run(probe_twice())
    return seen


def test_a_health_probe_of_a_tracing_router_is_a_trace_sglang_leaves_out(sglang):
    sglang_trace, sglang_spans = sglang
    first, second = probe_headers(traced=True)
    propagator = TraceContextTextMapPropagator()
    contexts = [propagator.extract({"traceparent": h["traceparent"]}) for h in (first, second)]
    parents = [next(iter(c.values())).get_span_context() for c in contexts]
    assert all(p.is_valid and not p.trace_flags.sampled for p in parents)
    assert parents[0].trace_id != parents[1].trace_id  # a trace per probe: never one that grows forever
    sglang_request(sglang_trace, dict(first), "decode", "health", 0)
    assert sglang_spans.get_finished_spans() == ()
    assert all("traceparent" not in h for h in probe_headers(traced=False))  # tracing off: nothing sent
