"""One PD request from the client's side: check it, then attempt it on a pair (router/pd/pairing.py chooses,
router/pd/attempt.py attempts), again on a new pair after a retryable failure before the first byte, and account
for it (status metric, latency, X-Request-ID, a log line). An OpenAI request for n > 1 choices is n such requests
(router/openai/fanout.py), accounted for as one."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson

from pdcluster.common.http import ApiError, Incoming, check_bearer, parse_json_object
from router.admission.gate import Gate, Refused
from router.admission.queue_wait import WaitModel
from router.admission.tenants import Tenancy, Tenant, priority_for
from router.checks.checked import Checked
from router.checks.validation import check_chat, check_completion, check_generate
from router.config import RouterConfig
from router.metrics import CURRENT_TENANT, RouterMetrics
from router.openai import fanout, openai_answer
from router.openai.responses_api import RESPONSES_ROUTE, ResponsesApi
from router.openai.responses_render import CHAT_ROUTE
from router.pd.attempt import Attempt, Dispatcher
from router.pd.failures import HalfFailed
from router.pd.fan_out_options import FanOutOptions
from router.pd.kv_fit import count_prompt, refuse_empty_texts
from router.pd.pairing import Pairing, PromptTooLong, check_for_pair, pair_limits
from router.pd.request import PdRequest, new_rid
from router.tracing import spans
from router.transport.edge import Answer, EdgeRequest, Route, StreamAnswer, error_answer

log = logging.getLogger("pdcluster.router")

# A client's request id is echoed back and logged, never sent to SGLang (which aborts by rid prefix).
CLIENT_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# The PD routes, each with the check of its bodies (router/checks/validation.py).
CHECKS: dict[str, Callable[[dict[str, Any]], Checked]] = {
    "/generate": check_generate, "/v1/completions": check_completion, "/v1/chat/completions": check_chat}


def client_request_id(value: str) -> str:
    if not CLIENT_ID.fullmatch(value):
        raise ApiError(400, "X-Request-ID must be 1-128 characters of A-Z a-z 0-9 . _ : @ / + = -", "X-Request-ID")
    return value


class PdService:
    dispatcher: Dispatcher  # set at start-up, before the first request (it owns the upstream connections)

    def __init__(self, config: RouterConfig, pairing: Pairing, metrics: RouterMetrics, api_key: str | None):
        self.config, self.pairing, self.metrics, self.api_key = config, pairing, metrics, api_key
        self.tracing = spans.from_config(config, metrics.spans_dropped.inc)  # None when off: no span is made
        self.responses = ResponsesApi()  # POST /v1/responses, as a chat request; its store is opened at start-up
        # admission by predicted prefill wait (router/admission/gate.py)
        self.gate = Gate(config.admission, pairing.pool, metrics, WaitModel.from_config(config.admission))
        self.tenancy = Tenancy(config, metrics)  # `tenancy.tenant_of(request)`: who a request is for

    def authenticate(self, http: Incoming) -> Tenant | None:
        """The request's tenant (401 for a key of none); with no tenants, None after the shared key's check."""
        if (tenant := self.tenancy.authenticate(http)) is None:
            check_bearer(http, self.api_key)  # the single-tenant case
        return tenant

    def owner_of(self, http: Incoming) -> str:
        """The caller let in (401 otherwise), and who owns what it stores and reads (stored responses and
        conversations): its tenant, else its key's digest (router/admission/tenants.py)."""
        tenant = self.authenticate(http)
        return tenant.name if tenant is not None else self.tenancy.tenant_of(http)

    def routes(self) -> dict[str, Route]:
        """The edge's PD routes (router/transport/edge.py): each path answered by `answer`."""
        def route(path: str) -> Route:
            async def handle(http: EdgeRequest) -> Answer | StreamAnswer:
                return await self.answer(http, path)
            return handle
        return {path: route(path) for path in (*CHECKS, RESPONSES_ROUTE)}

    async def answer(self, http: EdgeRequest, route: str) -> Answer | StreamAnswer:
        started = time.monotonic()
        traced = self.tracing.start(http.headers, route) if self.tracing is not None else None
        request_id = http.headers.get("x-request-id")
        CURRENT_TENANT.set(None)  # set once its key is read (router/admission/tenants.py), for its metrics
        try:
            request_id = client_request_id(request_id) if request_id is not None else new_rid()
            async with asyncio.timeout(self.config.total_timeout):
                answer = await self._attempts(http, route, request_id, started)
        except ApiError as exc:
            answer = error_answer(exc.status, exc.message, exc.param, exc.kind)
            if isinstance(exc, Refused):
                answer.headers["retry-after"] = str(exc.retry_after)
            request_id = request_id if isinstance(request_id, str) and CLIENT_ID.fullmatch(request_id) else new_rid()
        except TimeoutError:  # raised inside the `async with` only: request_id is set
            assert request_id is not None
            answer = error_answer(504, f"request took longer than total_timeout ({self.config.total_timeout}s)")
        except BaseException as exc:  # the client left (cancelled) or a defect (the edge's 500)
            if traced is not None and self.tracing is not None:
                self.tracing.abandon(traced, exc)
            raise
        answer.headers["x-request-id"] = request_id
        self.metrics.requests.labels(route, str(answer.status)).inc()
        if (tenant := CURRENT_TENANT.get()) is not None:
            self.metrics.tenant_requests.labels(tenant, str(answer.status)).inc()
        streaming = isinstance(answer, StreamAnswer)
        if not streaming:
            self.metrics.latency.labels(route).observe(time.monotonic() - started)
        if log.isEnabledFor(logging.INFO):
            log.info("answered", extra={"request_id": request_id, "route": route, "status": answer.status,
                                        "ms": round((time.monotonic() - started) * 1000, 1), "streaming": streaming})
        if traced is not None and self.tracing is not None:  # after the log line, which carries the span's ids
            self.tracing.finish(traced, answer, request_id)
        return answer

    async def _attempts(self, http: EdgeRequest, route: str, request_id: str, started: float) -> Answer | StreamAnswer:
        config = self.config
        tenant = self.authenticate(http)
        body = parse_json_object(await http.body(config.max_body_bytes), orjson.loads)
        if route == RESPONSES_ROUTE:  # served as the chat request of its conversation
            def chat_request(chat: dict[str, Any], checked: Checked) -> PdRequest:
                return PdRequest(CHAT_ROUTE, request_id, chat, checked, started, config.total_timeout)
            return await self.responses.answer(body, self.owner_of(http), chat_request, self.serve)
        request = PdRequest(route, request_id, body, CHECKS[route](body), started, config.total_timeout)
        if request.checked.client_rid and log.isEnabledFor(logging.INFO):
            log.info("client id", extra={"request_id": request_id, "client_rid": request.checked.client_rid})
        tokens, weight = request.checked.prompt_tokens, tenant.config.weight if tenant is not None else 1.0
        with self.tenancy.within_quota(tenant, tokens):  # or a 429
            async with self.gate.admitted(self.tenancy.priority_class(tenant), tokens, tenant.name if tenant else "",
                                          weight):  # or a 429
                if request.checked.choices > 1:  # OpenAI's `n`: a request per choice, one answer of them all
                    return await fanout.answer(request, self.serve, config, self.metrics)
                return await self.serve(request)

    async def serve(self, request: PdRequest, fanned: FanOutOptions | None = None) -> Answer | StreamAnswer:
        """The request's attempts, each on a pair, until one answers or a failure is final. `fanned`: the options of
        one choice of a fan-out's (router/openai/fanout.py)."""
        config, route, request_id = self.config, request.route, request.request_id
        prefer = fanned.prefer_prefill if fanned is not None else None  # a fan-out's later choice: its prefill
        view = await self.pairing.view(request, prepared=prefer is None)
        while True:
            try:
                choice = self.pairing.choose(request, view, prefer)
            except PromptTooLong as short:
                if request.checked.prompt_exact:
                    raise short.refusal(request.checked) from None
                tokens = await count_prompt(self.dispatcher.client, short.decode, request)
                request.checked = replace(request.checked, longest_prompt=tokens, prompt_exact=True)
                continue
            prefill, decode = choice.prefill, choice.decode
            check_for_pair(request.checked, pair_limits(prefill, decode))
            if request.checked.may_vanish:  # once: every pair serves the same model
                await refuse_empty_texts(self.dispatcher.client, decode, request.checked)
                request.checked = replace(request.checked, may_vanish=())
            request.start_attempt(prefill)
            priority_for(request.body, prefill, decode)  # its tenant's class's, where both workers schedule by it
            if log.isEnabledFor(logging.INFO):
                log.info("dispatch", extra={"request_id": request_id, "route": route, "attempt": request.attempt,
                                            "prefill": prefill.url, "decode": decode.url, "stream": request.stream,
                                            "rids": request.rids})
            try:
                attempt = Attempt(self.dispatcher, request, choice, fanned)
                trace = spans.current() if self.tracing is not None else None
                self.gate.dispatched()  # its prefill half books the prompt now (no await between)
                answer = await (attempt.answer() if trace is None else trace.attempt(attempt))
            except HalfFailed as failure:
                log.warning("attempt failed", extra={"request_id": request_id, "attempt": request.attempt,
                                                     "error": failure.message, "detail": failure.detail,
                                                     "retryable": failure.retryable})
                if not failure.retryable or request.attempt + 1 == config.max_attempts:
                    return failure.answer()
                request.tried.add(failure.worker.worker_id)
                self.metrics.retries.labels(route).inc()
                await asyncio.sleep(config.retry_backoff * (2**request.attempt) * (0.5 + random.random()))
                continue
            if config.expose_worker_ids:
                answer.headers["x-pdcluster-prefill"] = prefill.worker_id
                answer.headers["x-pdcluster-decode"] = decode.worker_id
                if choice.predicted_cached is not None:  # the KV index chose the prefill: what it expected there
                    answer.headers["x-pdcluster-cached-tokens-predicted"] = str(choice.predicted_cached)
            if route == "/generate":
                return answer
            return openai_answer.shaped(answer, route, request.body, request.checked.legacy_functions,
                                        openai_answer.seed_fingerprint(request.body, prefill, decode))
