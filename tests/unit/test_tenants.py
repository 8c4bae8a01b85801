"""Tenants (router/admission/tenants.py, router/admission/fair_queue.py): keys by their sha256 only, never logged;
quotas refused with 429 + Retry-After while other tenants are served; the weighted fair queue; `tenant_of`; SGLang's
priority only where both workers schedule by it; the per-tenant metrics."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from pydantic import ValidationError

from pdcluster.common.protocol import Role, WorkerCapabilities
from router.admission.fair_queue import FairQueue
from router.admission.tenants import CURRENT_PRIORITY, Tenancy, priority_for
from router.app import create_app
from router.config import AdmissionConfig, PriorityClass, RouterConfig
from router.fleet.workers import Worker, WorkerPool
from router.metrics import RouterMetrics
from tests.fakes import FakeWorker, ServerThread
from tests.unit.test_admission_wait import gate_on, prefill

GOLD_KEY, FREE_KEY = "sk-gold-0123456789", "sk-free-9876543210"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = {"gold": {"key_sha256": [sha(GOLD_KEY)], "priority_class": "high", "weight": 3},
           "free": {"key_sha256": [sha(FREE_KEY)], "requests_per_second": 1, "concurrent_requests": 2}}
ADMISSION = {"classes": {"default": {}, "high": {"priority": 5}}}


class Request:
    def __init__(self, key: str | None):
        self.headers = {"authorization": f"Bearer {key}"} if key else {}


def tenancy(**config) -> Tenancy:
    cfg = RouterConfig(bootstrap_url=None, **config)
    return Tenancy(cfg, RouterMetrics(WorkerPool()))


def test_a_key_names_its_tenant_and_tenant_of_says_whose_a_request_is():
    tenants = tenancy(tenants=TENANTS, admission=ADMISSION)
    assert tenants.tenant_of(Request(GOLD_KEY)) == "gold" and tenants.tenant_of(Request(FREE_KEY)) == "free"
    for key in ("sk-unknown", None, sha(GOLD_KEY)):  # a key's digest is not a key
        with pytest.raises(Exception, match="missing or unknown API key"):
            tenants.authenticate(Request(key))
    single = tenancy()
    assert single.tenant_of(Request(GOLD_KEY)) == sha(GOLD_KEY)  # no tenants: the bearer's sha256
    assert single.tenant_of(Request(None)) == "anonymous"


def test_tenants_name_known_classes_and_no_key_twice_and_not_beside_api_key(tmp_path):
    with pytest.raises(ValidationError, match=r"not in admission\.classes"):
        RouterConfig(tenants=TENANTS)
    with pytest.raises(ValidationError, match="share a key"):
        RouterConfig(tenants={"a": {"key_sha256": [sha("k")]}, "b": {"key_sha256": [sha("k")]}})
    with pytest.raises(ValidationError, match="single-tenant case"):
        RouterConfig(api_key="shared", tenants={"a": {"key_sha256": [sha("k")]}})
    secret = tmp_path / "tenants.yaml"  # a Kubernetes Secret mounted as a file
    secret.write_text(f"team-b:\n  key_sha256: ['{sha('kb')}']\n")
    tenants = tenancy(tenants={"a": {"key_sha256": [sha("ka")]}}, tenants_file=str(secret))
    assert tenants.tenant_of(Request("kb")) == "team-b" and tenants.tenant_of(Request("ka")) == "a"


def test_the_fair_queue_serves_tenants_by_weight_and_each_in_order():
    queue: FairQueue[str] = FairQueue()
    for i in range(4):
        queue.append("big", 1.0, 100, f"big{i}")
    queue.append("small", 1.0, 100, "small0")  # queued last, served second: the big tenant's backlog is its own
    queue.append("heavy", 4.0, 100, "heavy0")  # weight 4: a quarter of the virtual time per token
    queue.append("heavy", 4.0, 100, "heavy1")
    assert [queue.popleft() for _ in range(len(queue))] == [
        "heavy0", "heavy1", "big0", "small0", "big1", "big2", "big3"]
    assert not queue and queue.head() is None


def test_one_tenants_burst_does_not_delay_another_in_the_routers_queue():
    worker = prefill(pending=3000)
    gate = gate_on(worker, config=AdmissionConfig(enabled=True, classes={
        "default": PriorityClass(max_predicted_wait=20, queue_wait=5)}))
    order: list[str] = []

    async def request(name: str, tenant: str) -> None:
        async with gate.admitted("default", 500, tenant):
            order.append(name)
            gate.dispatched()
            worker.pending_work_tokens += 500

    async def scenario() -> None:
        tasks = []
        for name, tenant in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")):
            tasks.append(asyncio.create_task(request(name, tenant)))
            await asyncio.sleep(0.01)
        worker.pending_work_tokens = 0
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert order == ["a1", "b1", "a2", "a3"]


def test_priority_reaches_sglang_only_where_both_workers_schedule_by_it():
    on = WorkerCapabilities(priority_scheduling=True)
    p_on, d_on = Worker("p", Role.PREFILL, "http://p", capabilities=on), Worker("d", Role.DECODE, "http://d",
                                                                              capabilities=on)
    d_off = Worker("d2", Role.DECODE, "http://d2")
    CURRENT_PRIORITY.set(5)
    body: dict = {"priority": 99}
    priority_for(body, p_on, d_on)
    assert body["priority"] == 5
    priority_for(body, p_on, d_off)
    assert "priority" not in body


@contextmanager
def served(**config):
    prefill_worker, decode_worker = FakeWorker(), FakeWorker()
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(prefill_worker.app()))
        d = stack.enter_context(ServerThread(decode_worker.app()))
        cfg = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999,
                                                         "priority_scheduling": True}],
                           decode=[{"url": d.url, "priority_scheduling": True}], admission_check=False,
                           log_level="info", **config)
        router = stack.enter_context(ServerThread(create_app(cfg)))
        yield router.url, prefill_worker, decode_worker


def post(url: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "hi"}, headers=headers, timeout=30)


def test_a_tenant_over_its_quota_gets_a_429_while_another_is_served_and_no_key_is_logged(caplog):
    caplog.set_level(logging.DEBUG)
    with served(tenants=TENANTS, admission=ADMISSION) as (url, prefill_worker, decode_worker):
        assert post(url, FREE_KEY).status_code == 200
        over = post(url, FREE_KEY)  # a second within the second: over 1 request per second
        gold = [post(url, GOLD_KEY) for _ in range(3)]
        wrong = post(url, "sk-wrong")
        models = [httpx.get(f"{url}/v1/models", headers=h).status_code
                  for h in ({}, {"authorization": f"Bearer {GOLD_KEY}"})]
        metrics = httpx.get(f"{url}/metrics").text
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    error = over.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", 429)
    assert "tenant free is over its quota of 1 requests per second" in error["message"]
    assert [r.status_code for r in gold] == [200] * 3 and wrong.status_code == 401
    assert models == [401, 200]  # the control routes too need a tenant's key
    assert len(decode_worker.received) == 4  # the free tenant's first and gold's three
    assert [body["priority"] for body in decode_worker.received] == [0, 5, 5, 5]  # by class, both halves
    assert [body["priority"] for body in prefill_worker.received] == [0, 5, 5, 5]
    assert 'pdcluster_router_tenant_refusals_total{reason="requests_per_second",tenant="free"} 1.0' in metrics
    assert 'pdcluster_router_tenant_requests_total{status="200",tenant="gold"} 3.0' in metrics
    assert 'pdcluster_router_tenant_requests_total{status="429",tenant="free"} 1.0' in metrics
    assert 'pdcluster_router_tenant_prompt_tokens_total{tenant="gold"}' in metrics
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "answered" in logged  # the log was captured
    for secret in (GOLD_KEY, FREE_KEY, "sk-wrong", sha(GOLD_KEY), sha(FREE_KEY), sha("sk-wrong")):
        assert secret not in logged


def test_concurrent_requests_and_tokens_per_minute_quotas():
    tenants = tenancy(tenants={"t": {"key_sha256": [sha("k")], "concurrent_requests": 1, "tokens_per_minute": 600}})
    tenant = tenants.tenants["t"]
    with tenants.within_quota(tenant, 400):
        with pytest.raises(Exception, match="1 concurrent requests") as refused, tenants.within_quota(tenant, 1):
            pass
        assert refused.value.retry_after == 1
    with pytest.raises(Exception, match="600 tokens per minute") as refused, tenants.within_quota(tenant, 400):
        pass
    assert refused.value.retry_after == 20  # 200 tokens left, 400 asked: 200 more at 10 tokens/s
