"""The router's HTTP API: SGLang's native /generate and the OpenAI API, each request served by a PD pair."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pdcluster.http import ApiError, check_bearer, error_response, install_error_handlers, read_json_object
from pdcluster.protocol import Role
from router import health
from router.config import RouterConfig
from router.breaker import CircuitBreaker
from router.dispatch import Dispatcher, Exchange, HalfFailed
from router.logprobs import wants_logprobs
from router.metrics import RouterMetrics
from router.policies import RequestHint, make_policy
from router.rooms import inject_pd_fields, new_request_id
from router.validation import Checked, check_chat, check_completion, check_generate
from router.workers import Worker, WorkerPool

log = logging.getLogger("pdcluster.router")


def create_app(config: RouterConfig, pool: WorkerPool | None = None) -> FastAPI:
    pool = pool or WorkerPool(make_breaker=lambda: CircuitBreaker(config.breaker_threshold, config.breaker_cooldown))
    pool.add_static(Role.PREFILL, config.prefill)
    pool.add_static(Role.DECODE, config.decode)
    prefill_policy, decode_policy = make_policy(config.prefill_policy), make_policy(config.decode_policy)
    api_key = config.resolved_api_key()
    metrics = RouterMetrics(pool)
    background: set[asyncio.Task] = set()
    state: dict[str, Any] = {}

    def on_failure(failure: HalfFailed) -> None:
        if failure.status >= 500 or failure.status == 429:
            failure.worker.breaker.on_failure()
        if failure.transport:  # unreachable or dropped the connection: out of rotation until a probe succeeds
            health.mark_failed(failure.worker, threshold=1)
            metrics.ejections.labels(failure.worker.role.value).inc()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        timeout = httpx.Timeout(config.read_timeout, connect=config.connect_timeout)
        # Control plane (discovery, probes, model info): httpx. Data plane (every request's two halves): aiohttp.
        client = httpx.AsyncClient(limits=limits, timeout=timeout)
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout, sock_read=config.read_timeout),
            auto_decompress=False,  # bytes are relayed as the worker sent them
        )
        state["dispatcher"] = Dispatcher(session, metrics, background, config.first_byte_timeout, on_failure)
        state["client"] = client
        tasks = [asyncio.create_task(health.probe_forever(config, pool, client))]
        if config.bootstrap_url:
            tasks.append(asyncio.create_task(health.follow_registry(config, pool, client)))
        yield
        for task in [*tasks, *background]:
            task.cancel()
        await asyncio.gather(*tasks, *background, return_exceptions=True)
        await client.aclose()
        await session.close()

    app = FastAPI(title="pdcluster router", lifespan=lifespan)
    app.state.pool = pool
    app.state.metrics = metrics
    install_error_handlers(app)

    def choose_pair(hint: RequestHint, tried: set[str]) -> tuple[Worker, Worker]:
        prefills = pool.candidates(Role.PREFILL, tried) or pool.candidates(Role.PREFILL)
        decodes = pool.candidates(Role.DECODE, tried) or pool.candidates(Role.DECODE)
        # Only decodes that some prefill can send KV to (same model, page size, KV dtype, transfer backend).
        pairable = [d for d in decodes if any(p.compatible_with(d) for p in prefills)]
        if not pairable:
            detail = "no prefill is compatible with any decode" if prefills and decodes else (
                f"{len(prefills)} prefill and {len(decodes)} decode workers available")
            raise ApiError(503, f"no healthy pair: {detail}")
        decode = decode_policy.choose(pairable, hint)
        return prefill_policy.choose([p for p in prefills if p.compatible_with(decode)], hint), decode

    async def serve_pd(request: Request, route: str, check: Callable[[dict[str, Any]], Checked]) -> Response:
        started = time.monotonic()
        request_id = request.headers.get("x-request-id") or new_request_id()
        try:
            response = await asyncio.wait_for(attempts(request, route, check, request_id), config.total_timeout)
        except ApiError as exc:
            response = error_response(exc.status, exc.message, exc.param)
        except asyncio.TimeoutError:
            response = error_response(504, f"request took longer than total_timeout ({config.total_timeout}s)")
        response.headers["x-request-id"] = request_id
        metrics.requests.labels(route, str(response.status_code)).inc()
        log.info("answered", extra={"request_id": request_id, "route": route, "status": response.status_code,
                                    "ms": round((time.monotonic() - started) * 1000, 1),
                                    "streaming": isinstance(response, StreamingResponse)})
        if not isinstance(response, StreamingResponse):
            metrics.latency.labels(route).observe(time.monotonic() - started)
        return response

    async def attempts(request: Request, route: str, check: Callable[[dict[str, Any]], Checked],
                       request_id: str) -> Response:
        check_bearer(request, api_key)
        original = await read_json_object(request, config.max_body_bytes)
        checked = check(original)
        tried: set[str] = set()
        for attempt in range(config.max_attempts):
            prefill, decode = choose_pair(RequestHint(checked.prompt), tried)
            body = copy.deepcopy(original)
            suffix = f"-retry{attempt}" if attempt else ""
            if suffix and body.get("rid") is not None:  # a retried rid must not collide with the aborted one
                body["rid"] = [r + suffix for r in body["rid"]] if isinstance(body["rid"], list) else body["rid"] + suffix
            rids = inject_pd_fields(body, prefill, checked.batch_size, request_id + suffix)
            log.info("dispatch", extra={"request_id": request_id, "route": route, "attempt": attempt,
                                        "prefill": prefill.url, "decode": decode.url, "stream": checked.stream})
            exchange = Exchange(prefill, decode, route, rids, checked.stream, {"x-request-id": request_id},
                                merge_logprobs=route == "/generate" and wants_logprobs(original))
            prefill.breaker.on_attempt()
            decode.breaker.on_attempt()
            try:
                response = await state["dispatcher"].forward(exchange, body)
            except HalfFailed as failure:
                on_failure(failure)
                log.warning("attempt failed", extra={"request_id": request_id, "attempt": attempt,
                                                     "error": failure.message, "retryable": failure.retryable})
                if not failure.retryable or attempt + 1 == config.max_attempts:
                    return failure.response()
                tried.add(failure.worker.worker_id)
                metrics.retries.labels(route).inc()
                await asyncio.sleep(config.retry_backoff * (2**attempt) * (0.5 + random.random()))
                continue
            prefill.breaker.on_success()
            decode.breaker.on_success()
            response.headers["x-pdcluster-prefill"] = prefill.worker_id
            response.headers["x-pdcluster-decode"] = decode.worker_id
            return response
        raise AssertionError("unreachable: the last attempt returns")

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

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def alive() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, detail = pool.readiness()
        workers = [
            {"worker_id": w.worker_id, "role": w.role.value, "url": w.url, "healthy": w.healthy,
             "breaker": w.breaker.state.name.lower(), "in_flight": w.in_flight, "incompatible": w.incompatible}
            for w in pool.workers.values()
        ]
        return JSONResponse({"ready": ok, "detail": detail, "workers": workers}, status_code=200 if ok else 503)

    return app
