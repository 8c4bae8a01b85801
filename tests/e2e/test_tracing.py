"""One trace per request across the cluster, at a real OTLP/HTTP collector (conftest.py's otlp_receiver): the router's
server span, its attempts, each attempt's prefill and decode legs, and under each leg the SGLang spans of the worker
it reached, for a plain, a streamed (native and OpenAI), a failed and a retried request.

What SGLang 0.5.23 makes of a leg's `traceparent` (read in its source: tests/unit/test_router_tracing_sglang.py): a
`<role> Req` span, child of the leg, the thread spans of its HTTP process and of its scheduler under it, the request's
stages under those. Its KV transfer (module `mooncake`, on the prefill) is a trace of its own, found by the bootstrap
room alone.

The retry: a second router, on the same workers, reaches the decodes through proxies that fail one answer on demand
(tests/e2e/fault_proxy.py): SGLang's workers fail no request of the router's kind on their own.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import yaml

from bench.harness.otlp_receiver import Receiver, Span
from tests.e2e.conftest import REPO
from tests.e2e.fault_proxy import FaultProxy, Faults
from tests.helpers import CLUSTER_POLL, free_port, until, worker_url

ROLES = ("prefill", "decode")
WAIT = 120.0  # seconds for a trace's last spans: the exporters batch (the routers' each second, SGLang's each 0.5 s)
ASK = {"text": "Trace this request", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def collector(otlp_receiver: Receiver) -> Iterator[Receiver]:
    otlp_receiver.keep = True  # the spans of this module's time only
    yield otlp_receiver
    otlp_receiver.keep = False
    with otlp_receiver.lock:
        otlp_receiver.spans.clear()


def client_parent() -> tuple[str, str, dict[str, str]]:
    """A client's own trace: its trace id, its span's id and the `traceparent` that names them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def spans_where(collector: Receiver, keep: Callable[[Span], bool]) -> list[Span]:
    with collector.lock:
        return [s for s in collector.spans if keep(s)]


def leg_above(span: Span, by_id: dict[str, Span]) -> Span | None:
    """The first of the router's spans up the parent chain of SGLang's `span` (None: a parent not in yet)."""
    while span.service != "router":
        if span.parent_span_id not in by_id:
            return None
        span = by_id[span.parent_span_id]
    return span


def lacking(spans: list[Span], attempts: int, whole: tuple[str, ...] = ROLES) -> list[str]:
    """What the trace lacks of a request served through `attempts` pairs (empty: it is whole): one server span, its
    attempts, two legs each; under each leg SGLang's `<role> Req` span of its role (and, for the attempt that answered,
    its scheduler's spans); the parent chain of every SGLang span of the `whole` roles ending at the leg of its role
    (of the others': at no other span of the router's)."""
    servers = [s for s in spans if s.service == "router" and s.kind == "SERVER"]
    if len(servers) != 1:
        return [f"{len(servers)} server spans"]
    tried = {s.span_id: s for s in spans if s.name == "attempt" and s.parent_span_id == servers[0].span_id}
    legs = {s.span_id: s for s in spans if s.name in ROLES and s.kind == "CLIENT" and s.parent_span_id in tried}
    missing = [] if len(tried) == attempts else [f"{len(tried)} attempt spans of {attempts}"]
    for attempt in tried.values():
        if sorted(leg.name for leg in legs.values() if leg.parent_span_id == attempt.span_id) != sorted(ROLES):
            missing.append(f"attempt {attempt.attributes.get('pdcluster.attempt')}: not one leg per role")
    by_id = {s.span_id: s for s in spans}
    under: dict[str, list[Span]] = {leg_id: [] for leg_id in legs}
    for span in spans:
        if span.service not in ROLES:
            continue
        leg = leg_above(span, by_id)
        if leg is None and span.service in whole:
            missing.append(f"{span.service}'s {span.name!r}: its parent chain breaks (parent {span.parent_span_id})")
        elif leg is not None and (leg.span_id not in legs or leg.name != span.service):
            missing.append(f"{span.service}'s {span.name!r} is under the router's {leg.name!r}, not its leg")
        elif leg is not None:
            under[leg.span_id].append(span)
    for leg_id, found in under.items():
        leg, attempt = legs[leg_id], tried[legs[leg_id].parent_span_id]
        where = f"attempt {attempt.attributes.get('pdcluster.attempt')}'s {leg.name} leg"
        if not any(s.name.startswith(f"{leg.name} Req ") for s in found):
            missing.append(f"no SGLang `{leg.name} Req` span under {where}")
        scheduler = f"{leg.name.capitalize()} Scheduler"
        answered = attempt.attributes.get("pdcluster.outcome") == "delivered"
        if answered and not any(s.attributes.get("thread_label") == scheduler for s in found):
            missing.append(f"no span of the {scheduler} under {where}")
    return missing


def whole_trace(collector: Receiver, trace_id: str, attempts: int = 1,
                whole: tuple[str, ...] = ROLES) -> dict[str, list[Span]]:
    """The trace's spans by name, once it is whole (`lacking`); fails after WAIT saying what it still lacks."""
    missing: list[str] = []

    def done() -> bool:
        missing[:] = lacking(spans_where(collector, lambda s: s.trace_id == trace_id), attempts, whole)
        return not missing

    if not until(done, WAIT, 0.5):
        held = [(s.service, s.name, s.span_id, s.parent_span_id)
                for s in spans_where(collector, lambda s: s.trace_id == trace_id)]
        pytest.fail(f"trace {trace_id} after {WAIT:.0f}s lacks {missing}; it holds {held}")
    by_name: dict[str, list[Span]] = {}
    for span in spans_where(collector, lambda s: s.trace_id == trace_id):
        by_name.setdefault(span.name, []).append(span)
    return by_name


def roots(by_name: dict[str, list[Span]], role: str) -> list[Span]:
    return [s for name, spans in by_name.items() if name.startswith(f"{role} Req ") for s in spans]


def test_a_plain_generate_is_one_trace_of_the_router_and_both_workers(router, collector):
    request_id = f"trace-plain-{uuid.uuid4().hex[:12]}"
    response = router.post("/generate", json=ASK, headers={"x-request-id": request_id})
    assert response.status_code == 200, response.text

    def server() -> list[Span]:
        return spans_where(collector, lambda s: s.kind == "SERVER" and s.attributes.get("pdcluster.request_id")
                           == request_id)

    assert until(server, WAIT, 0.5), f"no server span with request id {request_id}"
    (mine,) = server()
    assert mine.parent_span_id == ""  # the router's own trace: the client sent none
    by_name = whole_trace(collector, mine.trace_id)
    (attempt,) = by_name["attempt"]
    room = attempt.attributes["bootstrap_room"]
    assert room == hex(attempt.attributes["pdcluster.bootstrap_room"])  # as SGLang writes it
    for role in ROLES:
        (root,) = roots(by_name, role)
        assert root.attributes["bootstrap_room"] == room and root.attributes["module"] == "sglang::request"

    # The prefill's KV transfer: SGLang traces it apart (no trace context reaches it), under the same room.
    def transfer() -> list[Span]:
        return spans_where(collector, lambda s: s.service == "prefill" and s.attributes.get("bootstrap_room") == room
                           and s.attributes.get("module") == "sglang::mooncake")
    assert until(transfer, WAIT, 0.5), f"no Mooncake span of room {room}"
    assert {s.trace_id for s in transfer()}.isdisjoint({mine.trace_id})


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {**ASK, "stream": True}),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "Trace this request", "max_tokens": 4, "stream": True}),
], ids=["generate", "openai"])
def test_a_streamed_request_joins_the_clients_trace_with_both_workers(router, collector, path, body):
    trace_id, parent, headers = client_parent()
    with router.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events[-3:]
    by_name = whole_trace(collector, trace_id)
    (server,) = by_name[f"POST {path}"]
    assert server.parent_span_id == parent and server.attributes["http.response.status_code"] == 200
    assert by_name["attempt"][0].attributes["pdcluster.outcome"] == "delivered"


def test_a_request_a_worker_fails_is_one_trace_with_both_workers_spans(router, collector):
    """SGLang's prefill answers a grammar that admits no token with a 500 (a 400 for the client: the request's fault);
    the router aborts the decode, whose scheduler then leaves its span of the request open until Python frees the
    request (SGLang's TraceReqContext.__del__ ends it): the decode's stages may wait for their parent a long time, so
    only the prefill's chains are asked to be whole, and the decode's `decode Req` span to be the leg's child."""
    trace_id, _, headers = client_parent()
    body = {"text": "a", "sampling_params": {"max_new_tokens": 4, "ebnf": "root ::= root"}}
    response = router.post("/generate", json=body, headers=headers)
    assert response.status_code == 400 and "grammar admits no token" in response.json()["error"]["message"]
    by_name = whole_trace(collector, trace_id, whole=("prefill",))
    (server,), (attempt,), (decode_leg,) = by_name["POST /generate"], by_name["attempt"], by_name["decode"]
    assert [root.parent_span_id for root in roots(by_name, "decode")] == [decode_leg.span_id]
    assert server.attributes["http.response.status_code"] == 400
    assert attempt.status == "ERROR" and attempt.attributes["pdcluster.retryable"] is False
    assert attempt.attributes["pdcluster.outcome"] == "failed before the first byte"
    assert "grammar" in attempt.attributes["pdcluster.failure"]


@pytest.fixture(scope="module")
def proxied(cluster, tmp_path_factory):
    """A second router (traced, as every component here) with prefill-0 and both decodes, these through proxies."""
    work, faults = tmp_path_factory.mktemp("traced-retry"), Faults()
    with FaultProxy(worker_url(cluster, "decode-0"), faults) as d0, \
            FaultProxy(worker_url(cluster, "decode-1"), faults) as d1, (work / "router.log").open("w") as log:
        port = free_port()
        (work / "router.yaml").write_text(yaml.safe_dump({
            "host": "127.0.0.1", "port": port, "bootstrap_url": None, "tracing": True, "log_level": "info",
            "prefill": [{"url": worker_url(cluster, "prefill-0"),
                         "kv_bootstrap_port": cluster.spec.prefill.first_kv_bootstrap_port}],
            "decode": [{"url": d0.url}, {"url": d1.url}],
            "admission_check": False, "expose_worker_ids": True, "retry_backoff": 0}))
        process = subprocess.Popen([sys.executable, "-m", "router", "--config", str(work / "router.yaml")], cwd=REPO,
                                   stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            assert until(lambda: _all_serve(url, 3), 120, CLUSTER_POLL), (work / "router.log").read_text()[-3000:]
            yield url, faults
        finally:
            process.terminate()
            process.wait(30)


def _all_serve(url: str, count: int) -> bool:
    try:
        workers = httpx.get(f"{url}/ready", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return len(workers) == count and not any(w["unusable"] for w in workers)


def test_a_retried_request_is_one_trace_with_both_attempts_and_the_workers_of_each(proxied, collector):
    url, faults = proxied
    faults.arm(503, b'{"object": "error", "message": "failed by the test", "type": "ServiceUnavailable", "code": 503}')
    trace_id, _, headers = client_parent()
    response = httpx.post(f"{url}/generate", json=ASK, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    assert faults.fired == 1
    by_name = whole_trace(collector, trace_id, attempts=2)
    first, second = sorted(by_name["attempt"], key=lambda s: s.attributes["pdcluster.attempt"])
    assert first.attributes["pdcluster.outcome"] == "failed before the first byte"
    assert first.attributes["pdcluster.retryable"] is True and first.status == "ERROR"
    assert second.attributes["pdcluster.outcome"] == "delivered"
    assert "answered 503" in second.attributes["pdcluster.retry_reason"]
    assert first.attributes["pdcluster.decode"] != second.attributes["pdcluster.decode"] == \
        response.headers["x-pdcluster-decode"]
    assert len(roots(by_name, "prefill")) == len(roots(by_name, "decode")) == 2  # each attempt's, on its own leg
