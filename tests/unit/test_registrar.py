"""The launcher's health verdict (pdcluster/worker/registrar.py): SGLang's /health waits for any output of its
scheduler, so a long forward pass keeps it waiting. A /health that times out while SGLang's processes burn CPU is a
busy worker (registered healthy); one that times out while they sit idle is a stuck one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import psutil
import pytest
from fastapi import FastAPI

from pdcluster.common.protocol import WorkerRegistration
from pdcluster.worker.registrar import BUSY_CORES, Registrar, forward_tokens
from tests.fakes import ServerThread, until


def slow_health_server() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        await asyncio.sleep(30)
        return {}

    return app


def registrar(url: str, command: tuple[str, ...] = ()) -> Registrar:
    plan = SimpleNamespace(registration=SimpleNamespace(worker_id="w"), health_url=f"{url}/health", command=command,
                           cluster=SimpleNamespace(resolved_token=lambda: None, bootstrap_url=None))
    return Registrar(plan, probe_timeout=1.0)  # type: ignore[arg-type]


def test_a_health_probe_that_times_out_is_busy_while_sglang_computes_and_a_failure_while_it_idles():
    """The verdict, with SGLang's CPU time given: the share of a core it used during the probe decides."""
    with ServerThread(slow_health_server()) as server, httpx.Client(timeout=1.0) as client:
        busy, clock = registrar(server.url), iter(range(0, 1000, 2))  # 2 CPU seconds per look: busy
        busy._cpu_seconds = lambda: float(next(clock))
        healthy, detail = busy._probe(client)
        assert healthy and detail.startswith("busy: /health waited 1s while SGLang used"), detail
        stuck = registrar(server.url)
        stuck._cpu_seconds = lambda: 5.0  # no CPU at all meanwhile: stuck, or stopped
        healthy, detail = stuck._probe(client)
        assert not healthy and "timed out" in detail, detail


def test_a_traced_sglangs_health_probe_is_a_trace_it_leaves_out():
    """SGLang traces each /health generation as a trace of its own: with --enable-trace, the probe's unsampled
    `traceparent` keeps it out (what SGLang then records: tests/unit/test_router_tracing_sglang.py)."""
    sent: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers)
        return httpx.Response(200)

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        for command in (("sglang", "--enable-trace"), ("sglang",)):
            assert registrar("http://sglang:1", command)._probe(client) == (True, "")
    traced, plain = sent
    assert traced["traceparent"].startswith("00-") and traced["traceparent"].endswith("-00")  # flags: not sampled
    assert "traceparent" not in plain


def test_sglangs_cpu_time_is_read_from_its_whole_process_tree():
    """A busy child counts, however loaded the machine: its CPU time only grows."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable,"
                               " '-c', 'while True: pass']); time.sleep(60)"])
    try:
        made = registrar("http://127.0.0.1:9")
        made._sglang = psutil.Process(parent.pid)
        time.sleep(0.5)
        first = made._cpu_seconds()
        time.sleep(1.0)
        assert made._cpu_seconds() > first + 0.05 > 0.05  # the grandchild's loop, not the sleeping parent
        assert BUSY_CORES < 0.5
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()


def test_a_stopping_worker_deregisters_at_once_and_its_heartbeats_never_register_it_again():
    from bootstrap.app import create_app as create_bootstrap
    from bootstrap.config import BootstrapConfig
    from tests.unit.test_bootstrap_service import registration

    with ServerThread(create_bootstrap(BootstrapConfig())) as service:
        made = registrar("http://127.0.0.1:9")
        made.plan.cluster.bootstrap_url, made.plan.cluster.heartbeat_interval = service.url, 0.05
        made.service = httpx.Client(base_url=service.url, timeout=3.0)
        made.registration = WorkerRegistration.model_validate(registration("w", kv_pool_tokens=4096))
        made._serving.set()
        made._threads[1].start()  # the heartbeats: they register it

        def listed() -> list[str]:
            return [w["registration"]["worker_id"] for w in httpx.get(f"{service.url}/v1/workers").json()["workers"]]

        assert until(lambda: listed() == ["w"])
        made.leave_pools()
        assert listed() == []
        time.sleep(0.5)  # ten heartbeat periods: nothing registers it again
        assert listed() == []
        made._stop.set()


def sglang_server_info(info: dict | None) -> FastAPI:
    app = FastAPI()

    @app.get("/server_info")
    async def server_info():
        return info if info is not None else 1 / 0  # None: SGLang answers 500

    return app


def test_the_kv_pool_sglang_sized_is_registered_and_a_decode_short_of_its_context_says_what_it_refuses(caplog):
    """The decode's pool (4352 tokens, as on a machine short of RAM) and reserve come from SGLang's /server_info; the
    registration carries them, and its prompt budget is what pairing keeps longer prompts from (router/pd/kv_fit.py):
    the pool, less the reserve and the allocator's page, in whole pages."""
    from tests.unit.test_bootstrap_service import registration

    info = {"max_total_num_tokens": 4352, "num_reserved_decode_tokens": 512}
    with ServerThread(sglang_server_info(info)) as sglang:
        made = registrar("http://127.0.0.1:9")
        made.registration = WorkerRegistration.model_validate(
            registration("d", page_size=64, url=sglang.url, context_length=8192))
        made._read_kv_pool()
    assert (made.registration.kv_pool_tokens, made.registration.reserved_decode_tokens) == (4352, 512)
    assert made.registration.prompt_budget == 3776 == (4352 - 512 - 64) // 64 * 64
    assert "prompts over 3776 tokens are sent to other decodes, or refused (400)" in caplog.text
    # A pool that holds the whole context plus the reserve: no budget (SGLang's own checks suffice).
    roomy = made.registration.model_copy(update={"kv_pool_tokens": 8192 + 512 + 64})
    assert roomy.prompt_budget is None
    assert roomy.model_copy(update={"kv_pool_tokens": 8192 + 512 + 63}).prompt_budget == 8128


def test_a_kv_pool_sglang_does_not_report_is_unknown_and_the_worker_registers_all_the_same():
    from tests.unit.test_bootstrap_service import registration

    with ServerThread(sglang_server_info(None)) as sglang:
        made = registrar("http://127.0.0.1:9")
        made.registration = WorkerRegistration.model_validate(registration("d", url=sglang.url))
        made._read_kv_pool()
    assert made.registration.kv_pool_tokens is None and made.registration.prompt_budget is None
    prefill = WorkerRegistration.model_validate(registration("p", role="prefill", kv_pool_tokens=10,
                                                             reserved_decode_tokens=0, context_length=100))
    assert prefill.prompt_budget is None  # a prefill computes a prompt; it pre-allocates nothing for a peer


@pytest.mark.parametrize(("info", "context", "expected"), [
    ({"chunked_prefill_size": 4096, "max_prefill_tokens": 16384}, 8192, 4096),  # the CPU profile: chunked
    ({"chunked_prefill_size": -1, "max_prefill_tokens": 16384}, 8192, 16384),  # no chunking: a batch...
    ({"chunked_prefill_size": -1, "max_prefill_tokens": 4096}, 8192, 8192),  # ... or one whole prompt
    ({"chunked_prefill_size": None}, None, None),  # SGLang does not say: unknown
])
def test_the_largest_forward_pass_is_read_from_sglang(info, context, expected):
    """What the router allows a silent prefill (router/fleet/liveness.py): one forward pass of this many tokens."""
    assert forward_tokens(info, context) == expected


def test_the_largest_forward_pass_is_registered():
    from tests.unit.test_bootstrap_service import registration

    info = {"max_total_num_tokens": 16384, "chunked_prefill_size": 4096, "max_prefill_tokens": 16384}
    with ServerThread(sglang_server_info(info)) as sglang:
        made = registrar("http://127.0.0.1:9")
        made.registration = WorkerRegistration.model_validate(registration("p", role="prefill", url=sglang.url))
        made._read_kv_pool()
    assert made.registration.forward_tokens == 4096


def test_a_worker_refused_for_its_kv_secret_says_why_once_and_joins_when_the_namespace_is_free(caplog):
    """The bootstrap service refuses a worker whose KV secret differs from its namespace's other workers (409,
    bootstrap/registry.py): the launcher logs the reason as one error, not one per heartbeat, keeps asking, and is
    registered as soon as the namespace's other workers are gone."""
    from bootstrap.app import create_app as create_bootstrap
    from bootstrap.config import BootstrapConfig
    from tests.unit.test_bootstrap_kv_secret import NS, kv_worker

    with ServerThread(create_bootstrap(BootstrapConfig())) as service:
        assert httpx.put(f"{service.url}/v1/workers/p1", json=kv_worker("p1", b"old")).status_code == 200
        made = registrar("http://127.0.0.1:9")
        made.plan.cluster.bootstrap_url, made.plan.cluster.heartbeat_interval = service.url, 0.05
        made.service = httpx.Client(base_url=service.url, timeout=3.0)
        made.registration = WorkerRegistration.model_validate(kv_worker("p2", b"new") | {"kv_pool_tokens": 4096})
        made._serving.set()
        made._threads[1].start()
        try:
            assert until(lambda: "refused to register p2 (409)" in caplog.text)
            time.sleep(0.5)  # ten more refused heartbeats
            errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
            assert len(errors) == 1 and not made.registered, errors
            assert f"kv secret differs from the other workers of KV namespace {NS} (p1)" in errors[0]
            assert "the worker gets no traffic until it accepts" in errors[0]
            httpx.delete(f"{service.url}/v1/workers/p1")
            assert until(lambda: made.registered)
            workers = httpx.get(f"{service.url}/v1/workers").json()["workers"]
            assert [w["registration"]["worker_id"] for w in workers] == ["p2"]
        finally:
            made._stop.set()
