"""HTTP API of the bootstrap service.

Writes (PUT /v1/workers/{id}, POST .../heartbeat, DELETE, POST and DELETE .../drain, POST .../switch and
.../switch/progress) need the shared token when one is configured.
GET /v1/workers lists the registry; with `?wait_version=N` it answers as soon as the version differs from N
(or after `timeout` seconds), which is how the router follows changes within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from bootstrap.config import BootstrapConfig
from bootstrap.registry import Refused, Registry
from bootstrap.switch import SwitchRefused
from pdcluster.common.http import (
    ApiError,
    check_bearer,
    error_body,
    first_validation_problem,
    install_error_handlers,
    read_json_object,
)
from pdcluster.common.protocol import (
    Heartbeat,
    Role,
    SwitchProgress,
    SwitchRequest,
    WorkerListing,
    WorkerRegistration,
    from_newer,
)

MAX_WAIT_SECONDS = 30.0
log = logging.getLogger("pdcluster.bootstrap")
REAPER_LAG = 1.0  # seconds the reaper may wake late before the time counts as this service's own stall
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
Parse = Callable[..., Awaitable[Any]]  # (request, model, newer_ok=False) -> the validated body


def create_app(config: BootstrapConfig, shutting_down: Callable[[], bool] = lambda: False) -> FastAPI:
    registry = Registry(config.ttl_seconds)
    token = config.resolved_token()
    app = FastAPI(title="pdcluster bootstrap service", lifespan=_reaper(registry, config, shutting_down))
    app.state.registry = registry
    install_error_handlers(app)
    _add_worker_routes(app, registry, token, _body_parser(token, config))
    _add_switch_routes(app, registry, _body_parser(token, config))
    _add_listing_route(app, registry)
    return app


def _reaper(registry: Registry, config: BootstrapConfig, shutting_down: Callable[[], bool]) -> Lifespan:
    """The app's lifespan: a task expiring the workers whose heartbeats stopped, for as long as the app runs."""

    async def reap() -> None:
        interval = min(0.5, config.ttl_seconds / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            lag, last = now - last - interval, now
            if lag > REAPER_LAG:
                # This service did not run meanwhile (seen in the e2e suite: every process of a busy 2-core machine
                # stalled ~6 s): the heartbeats of that time are still unread, so the time is nobody's fault. Without
                # this, a healthy worker was dropped, re-registered and re-admitted, and its pool had no decode.
                registry.forgive(lag)
                log.warning("bootstrap service stalled; not counted against workers", extra={"seconds": round(lag, 1)})
            # Once shutdown starts, heartbeats can no longer reach us: expiring now would tell long-polling routers
            # that live workers died (and they would drop them) just before this service goes away.
            if not shutting_down():
                await registry.expire()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(reap())
        yield
        task.cancel()

    return lifespan


def _body_parser(token: str | None, config: BootstrapConfig) -> Parse:
    """The writes' common first step: the token checked, then the JSON body read and validated."""
    warned: set[tuple[str, ...]] = set()

    async def parse(request: Request, model: type[BaseModel], newer_ok: bool = False):
        """`newer_ok`: a launcher's message, which a newer launcher (a rolling upgrade) may send with fields this
        service does not know: they are dropped and logged, the rest checked as strictly as always."""
        check_bearer(request, token)
        data = await read_json_object(request, config.max_body_bytes)
        try:
            if not newer_ok:
                return model.model_validate(data)
            parsed, dropped = from_newer(model, data)
            if dropped and (model.__name__, *dropped) not in warned:  # once: heartbeats come every second
                warned.add((model.__name__, *dropped))
                log.warning("a worker sent fields this service does not know (a newer pdcluster) in a %s: %s; "
                            "ignored, upgrade the bootstrap service", model.__name__, ", ".join(dropped))
            return parsed
        except ValidationError as exc:
            field, message = first_validation_problem(exc)
            raise ApiError(400, f"{field}: {message}", field) from None

    return parse


def _add_worker_routes(app: FastAPI, registry: Registry, token: str | None, parse: Parse) -> None:
    """/health and the writes: what the launchers send (register, heartbeat, deregister) and an operator's drain."""

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "workers": len(registry.listing().workers)}

    @app.put("/v1/workers/{worker_id}")
    async def register(worker_id: str, request: Request) -> dict:
        registration = await parse(request, WorkerRegistration, newer_ok=True)
        if registration.worker_id != worker_id:
            raise ApiError(400, f"worker_id {registration.worker_id!r} does not match the URL's {worker_id!r}",
                           "worker_id")
        try:
            row = await registry.register(registration)
        except Refused as exc:
            log.warning("registration of %s refused: %s", worker_id, exc)
            raise ApiError(409, str(exc), "kv_store") from None
        return {"worker": row.model_dump(mode="json"), "incompatible": row.incompatible}

    @app.post("/v1/workers/{worker_id}/heartbeat")
    async def heartbeat(worker_id: str, request: Request) -> dict:
        beat = await parse(request, Heartbeat, newer_ok=True)
        if not await registry.heartbeat(worker_id, beat):
            raise ApiError(404, f"worker {worker_id} is not registered")
        order = registry.switch_order(worker_id)  # how its launcher learns of a flip (pdcluster/worker/role_flip.py)
        return {"ok": True, **({"switch": order.model_dump(mode="json")} if order else {})}

    @app.post("/v1/workers/{worker_id}/drain")
    async def drain(worker_id: str, request: Request) -> dict:
        """Take the worker out of the routers' pools: it finishes what it has and gets nothing new."""
        return await _set_draining(registry, token, worker_id, request, True)

    @app.delete("/v1/workers/{worker_id}/drain")
    async def resume(worker_id: str, request: Request) -> dict:
        return await _set_draining(registry, token, worker_id, request, False)

    @app.delete("/v1/workers/{worker_id}")
    async def deregister(worker_id: str, request: Request) -> dict:
        check_bearer(request, token)
        if not await registry.deregister(worker_id):
            raise ApiError(404, f"worker {worker_id} is not registered")
        return {"ok": True}


async def _set_draining(registry: Registry, token: str | None, worker_id: str, request: Request,
                        draining: bool) -> dict:
    check_bearer(request, token)
    if not await registry.set_draining(worker_id, draining):
        raise ApiError(404, f"worker {worker_id} is not registered")
    return {"worker_id": worker_id, "draining": draining}


def _add_switch_routes(app: FastAPI, registry: Registry, parse: Parse) -> None:
    """A role flip (bootstrap/switch.py): asked by an operator or a planner, carried out by the worker's launcher."""

    @app.post("/v1/workers/{worker_id}/switch", status_code=202, response_model=None)
    async def switch(worker_id: str, request: Request) -> dict | JSONResponse:
        """Accepted (202): the worker drains now; the listing's `switch` says how the flip goes on and ends. Refused
        (409) before anything changes, with a stable code in the error body's `refusal`."""
        wanted = await parse(request, SwitchRequest)
        status = next((row for row in registry.listing().workers if row.registration.worker_id == worker_id), None)
        try:
            flip = await registry.request_switch(worker_id, wanted.to)
        except SwitchRefused as exc:
            log.warning("flip of %s to %s refused: %s", worker_id, wanted.to.value, exc)
            body = error_body(409, str(exc), "to" if exc.code == "same_role" else None)
            body["error"]["refusal"] = exc.code
            return JSONResponse(body, status_code=409)
        if flip is None or status is None:
            raise ApiError(404, f"worker {worker_id} is not registered")
        log.warning("flipping %s from %s to %s: draining", worker_id, status.registration.role.value, flip.to.value)
        return {"worker_id": worker_id, "from": status.registration.role.value, "to": flip.to.value,
                "state": flip.state}

    @app.post("/v1/workers/{worker_id}/switch/progress")
    async def progress(worker_id: str, request: Request) -> dict:
        report = await parse(request, SwitchProgress, newer_ok=True)
        if not await registry.switch_progress(worker_id, report.state, report.reason):
            raise ApiError(404, f"worker {worker_id} has no flip running")
        return {"ok": True}


def _add_listing_route(app: FastAPI, registry: Registry) -> None:
    """The routers' read: the registry, at once or, with `wait_version`, as soon as it changes."""

    @app.get("/v1/workers", response_model=WorkerListing)
    async def listing(role: Role | None = None, model: str | None = None, wait_version: int | None = None,
                      timeout: float = 10.0) -> WorkerListing:
        if wait_version is not None:
            await registry.wait_for_change(wait_version, max(0.0, min(timeout, MAX_WAIT_SECONDS)))
        return registry.listing(role, model)
