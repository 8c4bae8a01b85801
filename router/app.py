"""The router's HTTP API: SGLang's native /generate and the OpenAI API, each request served by a PD pair."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdcluster.http import ApiError, check_bearer, install_error_handlers, read_json_object
from pdcluster.protocol import Role
from router import health
from router.config import RouterConfig
from router.dispatch import Dispatcher, Pair
from router.policies import RequestHint, make_policy
from router.rooms import inject_pd_fields, new_request_id
from router.validation import Checked, check_chat, check_completion, check_generate
from router.workers import Worker, WorkerPool

log = logging.getLogger("pdcluster.router")


def create_app(config: RouterConfig, pool: WorkerPool | None = None) -> FastAPI:
    pool = pool or WorkerPool()
    pool.add_static(Role.PREFILL, config.prefill)
    pool.add_static(Role.DECODE, config.decode)
    prefill_policy, decode_policy = make_policy(config.prefill_policy), make_policy(config.decode_policy)
    api_key = config.resolved_api_key()
    background: set[asyncio.Task] = set()
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        timeout = httpx.Timeout(config.read_timeout, connect=config.connect_timeout)
        client = httpx.AsyncClient(limits=limits, timeout=timeout)
        state["dispatcher"] = Dispatcher(client, lambda w: health.mark_failed(w, threshold=1), background)
        state["client"] = client
        tasks = [asyncio.create_task(health.probe_forever(config, pool, client))]
        if config.bootstrap_url:
            tasks.append(asyncio.create_task(health.follow_registry(config, pool, client)))
        yield
        for task in [*tasks, *background]:
            task.cancel()
        await asyncio.gather(*tasks, *background, return_exceptions=True)
        await client.aclose()

    app = FastAPI(title="pdcluster router", lifespan=lifespan)
    app.state.pool = pool
    install_error_handlers(app)

    def choose_pair(hint: RequestHint) -> Pair:
        prefills, decodes = pool.healthy(Role.PREFILL), pool.healthy(Role.DECODE)
        if not prefills or not decodes:
            raise ApiError(503, f"no healthy pair: {len(prefills)} prefill and {len(decodes)} decode workers healthy")
        decode = decode_policy.choose(decodes, hint)
        compatible = [p for p in prefills if p.compatible_with(decode)]
        if not compatible:
            raise ApiError(503, f"no prefill is compatible with decode {decode.url}")
        return Pair(prefill_policy.choose(compatible, hint), decode)

    async def serve_pd(request: Request, path: str, check: Callable[[dict[str, Any]], Checked]) -> Response:
        check_bearer(request, api_key)
        body = await read_json_object(request, config.max_body_bytes)
        checked = check(body)
        request_id = request.headers.get("x-request-id") or new_request_id()
        pair = choose_pair(RequestHint(checked.prompt))
        rids = inject_pd_fields(body, pair.prefill, checked.batch_size, request_id)
        log.info("request_id=%s path=%s prefill=%s decode=%s stream=%s", request_id, path, pair.prefill.url,
                 pair.decode.url, checked.stream)
        response = await state["dispatcher"].forward(pair, path, body, rids, checked.stream,
                                                     {"x-request-id": request_id})
        response.headers["x-request-id"] = request_id
        return response

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await serve_pd(request, "/generate", check_generate)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_pd(request, "/v1/completions", check_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_pd(request, "/v1/chat/completions", check_chat)

    async def from_a_decode(request: Request, path: str) -> Response:
        check_bearer(request, api_key)
        decodes = pool.healthy(Role.DECODE)
        if not decodes:
            raise ApiError(503, "no healthy decode worker")
        worker: Worker = decodes[0]
        try:
            upstream = await state["client"].get(f"{worker.url}{path}", timeout=10.0)
        except httpx.HTTPError as exc:
            raise ApiError(502, f"decode {worker.url} failed: {type(exc).__name__}") from None
        return Response(upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await from_a_decode(request, "/v1/models")

    @app.get("/get_model_info")
    async def model_info(request: Request) -> Response:
        return await from_a_decode(request, "/get_model_info")

    @app.get("/health")
    async def alive() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, detail = pool.readiness()
        workers = [
            {"worker_id": w.worker_id, "role": w.role.value, "url": w.url, "healthy": w.healthy,
             "in_flight": w.in_flight, "incompatible": w.incompatible}
            for w in pool.workers.values()
        ]
        return JSONResponse({"ready": ok, "detail": detail, "workers": workers}, status_code=200 if ok else 503)

    return app
