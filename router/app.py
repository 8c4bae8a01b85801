"""The router's HTTP API: SGLang's native /generate and the OpenAI API, each request served by a PD pair."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST

from pdcluster.common.http import ApiError, install_error_handlers
from pdcluster.common.protocol import Role
from router import openapi
from router.config import RouterConfig
from router.fleet.discovery import FIRST_LISTING_WAIT, follow_registry, static_workers
from router.fleet.health import probe_forever
from router.fleet.workers import CircuitBreaker, Worker, WorkerPool
from router.kv_routing import kv_events
from router.metrics import RouterMetrics
from router.openai import conversations_routes, responses_routes
from router.pd.admission import Admissions
from router.pd.attempt import Dispatcher
from router.pd.pairing import Pairing
from router.pd.policies import make_policy
from router.service import PdService
from router.store import open_store
from router.transport.edge import Edge
from router.transport.upstream import UpstreamClient

# FastAPI 0.165 consults OpenTelemetry's global providers on every request unless told not to.
NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


async def _sample_every_second(metrics: RouterMetrics) -> None:
    while True:
        metrics.sample_pool()
        await asyncio.sleep(1.0)


def create_app(config: RouterConfig, pool: WorkerPool | None = None) -> Edge:
    """The router's ASGI app: the PD routes on the edge (router/transport/edge.py) in front of FastAPI's control
    routes."""
    pool = pool or WorkerPool(make_breaker=lambda: CircuitBreaker(config.breaker_threshold, config.breaker_cooldown),
                              admission_check=config.admission_check)
    pool.add_static(static_workers(config))
    api_key = config.resolved_api_key()
    metrics = RouterMetrics(pool)
    pairing = Pairing(pool, make_policy(config.prefill_policy), make_policy(config.decode_policy))
    pd = PdService(config, pairing, metrics, api_key)
    state: dict[str, Any] = {}
    app = FastAPI(title="pdcluster router", lifespan=_lifespan(config, pool, metrics, pd, state),
                  telemetry=NO_TELEMETRY)
    _serve_the_contract(app)
    app.state.pool = pool
    app.state.metrics = metrics
    install_error_handlers(app)
    _control_routes(app, pool, metrics, pd.authenticate, state)
    responses_routes.install(app, pd.responses, pd.owner_of)
    conversations_routes.install(app, pd.responses, pd.owner_of, config.max_body_bytes)
    # The PD routes are served by the edge, in front of FastAPI (why: router/transport/edge.py).
    return Edge(app, pd.routes())


def _lifespan(config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics, pd: PdService, state: dict[str, Any]):
    """Start-up: the clients, the attempts' shared context, probes, admissions and the first registry listing;
    shut-down: every task and connection, in that order."""
    admissions = Admissions(pool, lambda: pd.dispatcher, metrics)
    background: set[asyncio.Future] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        # Each router process opens its own store (its own engine and pool: router/processes.py); one that cannot be
        # opened fails the start.
        store = pd.responses.store = await open_store(config.store)
        # Idle connections are let go before the workers' own 5 s keep-alive (SGLang's and uvicorn's default) ends
        # them: a probe on a connection the worker is closing would fail for nothing.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=2.0)
        timeout = httpx.Timeout(config.read_timeout, connect=config.connect_timeout)
        # Control plane (discovery, probes, model info): httpx. Data plane (every request's two halves): upstream.
        client = httpx.AsyncClient(limits=limits, timeout=timeout)
        upstream = UpstreamClient(config.connect_timeout, config.read_timeout)
        pd.dispatcher = Dispatcher(upstream, metrics, background, config)
        state["client"] = client
        tasks = [asyncio.create_task(probe_forever(config, pool, client, upstream, pd.tracing is not None)),
                 asyncio.create_task(admissions.run()),
                 *kv_events.start(pd.pairing.prefill_policy, pool, metrics, upstream)]
        tasks += await _first_listing(config, pool, client, admissions)
        if store is not None:
            tasks.append(asyncio.create_task(store.sweep_forever()))
        if metrics.multiprocess:
            tasks.append(asyncio.create_task(_sample_every_second(metrics)))
        yield
        for task in [*tasks, *background]:
            task.cancel()
        await asyncio.gather(*tasks, *background, return_exceptions=True)
        await client.aclose()
        await upstream.close()
        if store is not None:
            await store.close()
        if pd.tracing is not None:
            pd.tracing.close()

    return lifespan


async def _first_listing(config: RouterConfig, pool: WorkerPool, client: httpx.AsyncClient,
                         admissions: Admissions) -> list[asyncio.Task]:
    """uvicorn starts listening only once the lifespan has started: a router (re)started under load then serves from
    its first request, with the pool the registry knows and its workers admitted (within FIRST_LISTING_WAIT).
    Returns the registry's follower task, if there is a registry."""
    tasks = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(FIRST_LISTING_WAIT):
            if config.bootstrap_url:
                first_listing = asyncio.Event()
                tasks.append(asyncio.create_task(follow_registry(config, pool, client, first_listing)))
                await first_listing.wait()
            admissions.settled.clear()
            await admissions.settled.wait()
    return tasks


def _serve_the_contract(app: FastAPI) -> None:
    """GET /openapi.json: the router's contract (router/openapi.py), made once, on the first request for it."""
    own_document = app.openapi

    def contract() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi.document(own_document())
        return app.openapi_schema

    app.openapi = contract  # type: ignore[method-assign]


def _control_routes(app: FastAPI, pool: WorkerPool, metrics: RouterMetrics,
                    authenticate: Callable[[Request], object], state: dict[str, Any]) -> None:
    """Everything but the PD routes: a decode's model list and info, metrics, liveness and readiness."""

    async def from_a_decode(request: Request, path: str) -> Response:
        authenticate(request)  # the shared key, or a tenant's
        decodes = pool.healthy(Role.DECODE)
        if not decodes:
            raise ApiError(503, "no healthy decode worker")
        worker: Worker = decodes[0]
        try:
            upstream = await state["client"].get(f"{worker.url}{path}", timeout=10.0)
        except httpx.HTTPError:
            raise ApiError(502, f"decode {worker.worker_id} did not answer") from None
        return Response(upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await from_a_decode(request, "/v1/models")

    @app.get("/v1/models/{model_id:path}", responses={404: {"description": "no served model has this id"}})
    async def model(request: Request, model_id: str) -> Response:
        """One model's card as SGLang answers it, found in a decode's list (a client's path never reaches a worker)."""
        return _model_card(await from_a_decode(request, "/v1/models"), model_id)

    @app.get("/get_model_info")
    async def model_info(request: Request) -> Response:
        return await from_a_decode(request, "/get_model_info")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def alive() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, detail = pool.readiness()
        return JSONResponse({"ready": ok, "detail": detail, "workers": [_worker_state(w) for w in
                                                                         pool.workers.values()]},
                            status_code=200 if ok else 503)


def _model_card(listed: Response, model_id: str) -> Response:
    """`model_id`'s card in a decode's /v1/models answer; 404 if it lists none (the decode's error, as it is)."""
    data = orjson.loads(listed.body).get("data") if listed.status_code == 200 else None
    if not isinstance(data, list):
        return listed
    for card in data:
        if isinstance(card, dict) and card.get("id") == model_id:
            return JSONResponse(card)
    raise ApiError(404, f"The model '{model_id}' does not exist", "model")


def _worker_state(w: Worker) -> dict[str, Any]:
    """A worker as /ready lists it: every reason it may get no traffic."""
    return {"worker_id": w.worker_id, "role": w.role.value, "url": w.url, "healthy": w.healthy,
            "draining": w.draining, "admission": w.admission.value, "admission_note": w.admission_note,
            "unusable": w.unusable(), "breaker": w.breaker.state.name.lower(), "in_flight": w.in_flight,
            "prompt_budget": w.prompt_budget, "incompatible": w.incompatible}
