"""HTTP edge shared by the router and the bootstrap service: JSON errors, bounded bodies, the shared token."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcluster.common.config_file import first_problem
from pdcluster.common.protocol import ErrorBody, ErrorDetail, ErrorType

_TYPE_BY_STATUS: dict[int, ErrorType] = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
    409: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_exceeded", 502: "upstream_error", 503: "unavailable", 504: "timeout",
}


class ApiError(Exception):
    """An error answer; `kind`: its `type` where the status's own is not precise enough (model_not_found)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: ErrorType | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(status: int, message: str, param: str | None = None, kind: ErrorType | None = None) -> dict[str, Any]:
    detail = ErrorDetail(message=message, type=kind or _TYPE_BY_STATUS.get(status, "upstream_error"), param=param,
                         code=status)
    return ErrorBody(error=detail).model_dump()


def error_parts(status: int, message: str, param: str | None = None,
                kind: ErrorType | None = None) -> tuple[bytes, dict[str, str]]:
    """The body and headers of every error answer, whatever sends it (FastAPI below, the router's edge)."""
    headers = {"content-type": "application/json"}
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return orjson.dumps(error_body(status, message, param, kind)), headers


def error_response(status: int, message: str, param: str | None = None, kind: ErrorType | None = None) -> Response:
    body, headers = error_parts(status, message, param, kind)
    return Response(body, status_code=status, headers=headers)


def first_validation_problem(exc: ValidationError | RequestValidationError) -> tuple[str, str]:
    """(field path, message) of the first problem pydantic found, for an error that names the field."""
    field, message = first_problem(exc)
    return field or "body", message


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> Response:
        field, message = first_validation_problem(exc)
        return error_response(400, f"{field}: {message}", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> Response:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response


# A refused body is still read, and thrown away, up to this many times the limit or this long: a client that sends a
# whole body before it reads the answer (urllib, `Connection: close`) would otherwise find its connection reset by
# our close while it still sends, and never read the 413 (nginx's lingering close does the same).
LINGER_FACTOR = 8
LINGER_SECONDS = 10.0


class Incoming(Protocol):
    """What read_body and check_bearer use of a request: Starlette's, or the router's edge's
    (router/transport/edge.py)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


async def read_body(request: Incoming, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes without buffering more than that.

    `request`: Starlette's, or anything with `headers` and an async `stream()` of body chunks
    (router/transport/edge.py)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        await _linger(request, request.stream(), limit)
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            await _linger(request, stream, limit)
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _linger(request: Incoming, stream: Any, limit: int) -> None:
    """Read and discard the rest of a refused body, within LINGER_FACTOR x `limit` bytes and LINGER_SECONDS."""
    if request.headers.get("expect", "").lower() == "100-continue":
        return  # the client sends nothing before our answer: reading would ask it to (100 Continue)
    budget = LINGER_FACTOR * limit
    with contextlib.suppress(Exception):  # the client left, or took too long: we answer (or close) anyway
        async with asyncio.timeout(LINGER_SECONDS):
            async for chunk in stream:
                budget -= len(chunk)
                if budget <= 0:
                    return


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    return parse_json_object(await read_body(request, limit))


def parse_json_object(body: bytes, loads: Callable[[bytes], Any] = json.loads) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying why not. `loads`: json.loads, or orjson.loads on a hot path."""
    try:
        data = loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # orjson's error subclasses json's
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def check_bearer(request: Incoming, token: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <token>`; a no-op when no token is configured."""
    if not token:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "missing or wrong bearer token")
