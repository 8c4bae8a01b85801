"""The launcher's health verdict (pdcluster/worker/registrar.py): SGLang's /health waits for any output of its
scheduler, so a long forward pass keeps it waiting. A /health that times out while SGLang's processes burn CPU is a
busy worker (registered healthy); one that times out while they sit idle is a stuck one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

from pdcluster.worker.registrar import Registrar
from tests.fakes import ServerThread


def slow_health_server() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        await asyncio.sleep(30)
        return {}

    return app


def registrar(url: str, child: subprocess.Popen) -> Registrar:
    plan = SimpleNamespace(registration=SimpleNamespace(worker_id="w"), health_url=f"{url}/health",
                           cluster=SimpleNamespace(resolved_token=lambda: None, bootstrap_url=None))
    made = Registrar(plan, probe_timeout=1.0)  # type: ignore[arg-type]
    made._sglang = __import__("psutil").Process(child.pid)
    return made


def test_a_health_probe_that_times_out_is_busy_while_sglang_computes_and_a_failure_while_it_idles():
    with ServerThread(slow_health_server()) as server, httpx.Client(timeout=1.0) as client:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a scheduler in a forward pass
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a stuck one
        try:
            healthy, detail = registrar(server.url, busy)._probe(client)
            assert healthy and detail.startswith("busy: /health waited 1s while SGLang used"), detail
            healthy, detail = registrar(server.url, idle)._probe(client)
            assert not healthy and "timed out" in detail, detail
        finally:
            busy.kill()
            idle.kill()
