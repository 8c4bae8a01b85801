"""One PD request from the client's side: check it, pick a pair, dispatch, retry on a new pair before the first
byte, and account for it (status metric, latency, X-Request-ID, a log line)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from pdcluster.http import ApiError, check_bearer, parse_json_object
from pdcluster.protocol import Role
from router.config import RouterConfig
from router.dispatch import Dispatcher, Exchange
from router.edge import Answer, EdgeRequest, StreamAnswer, error_answer
from router.failures import HalfFailed
from router.logprobs import wants_logprobs
from router.metrics import RouterMetrics
from router.policies import Policy, RequestHint
from router.rooms import inject_pd_fields, new_rid
from router.validation import CLIENT_ID, Checked, ModelLimits, check_token_ids, client_request_id
from router.workers import Worker, WorkerPool

log = logging.getLogger("pdcluster.router")

Check = Callable[[dict[str, Any]], Checked]


class PdService:
    def __init__(self, config: RouterConfig, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy,
                 metrics: RouterMetrics, api_key: str | None):
        self.config, self.pool, self.metrics, self.api_key = config, pool, metrics, api_key
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.dispatcher: Dispatcher | None = None  # set at start-up (it owns the upstream connections)

    def route(self, path: str, check: Check):
        async def serve(request: EdgeRequest) -> Answer | StreamAnswer:
            return await self.serve(request, path, check)
        return serve

    def choose_pair(self, hint: RequestHint, tried: set[str]) -> tuple[Worker, Worker]:
        pool = self.pool
        prefills = pool.candidates(Role.PREFILL, tried) or pool.candidates(Role.PREFILL)
        decodes = pool.candidates(Role.DECODE, tried) or pool.candidates(Role.DECODE)
        # Only decodes that some prefill can send KV to (same model, page size, KV dtype, transfer backend).
        pairable = [d for d in decodes if any(p.compatible_with(d) for p in prefills)]
        if not pairable:
            detail = "no prefill is compatible with any decode" if prefills and decodes else (
                f"{len(prefills)} prefill and {len(decodes)} decode workers available")
            raise ApiError(503, f"no healthy pair: {detail}")
        decode = self.decode_policy.choose(pairable, hint)
        return self.prefill_policy.choose([p for p in prefills if p.compatible_with(decode)], hint), decode

    async def serve(self, request: EdgeRequest, route: str, check: Check) -> Answer | StreamAnswer:
        started = time.monotonic()
        request_id = request.headers.get("x-request-id")
        try:
            request_id = client_request_id(request_id) if request_id is not None else new_rid()
            async with asyncio.timeout(self.config.total_timeout):
                answer = await self.attempts(request, route, check, request_id, started)
        except ApiError as exc:
            answer = error_answer(exc.status, exc.message, exc.param)
            request_id = request_id if isinstance(request_id, str) and CLIENT_ID.fullmatch(request_id) else new_rid()
        except TimeoutError:
            answer = error_answer(504, f"request took longer than total_timeout ({self.config.total_timeout}s)")
        answer.headers["x-request-id"] = request_id
        self.metrics.requests.labels(route, str(answer.status)).inc()
        streaming = isinstance(answer, StreamAnswer)
        if not streaming:
            self.metrics.latency.labels(route).observe(time.monotonic() - started)
        if log.isEnabledFor(logging.INFO):
            log.info("answered", extra={"request_id": request_id, "route": route, "status": answer.status,
                                        "ms": round((time.monotonic() - started) * 1000, 1), "streaming": streaming})
        return answer

    async def attempts(self, request: EdgeRequest, route: str, check: Check, request_id: str,
                       started: float) -> Answer | StreamAnswer:
        config = self.config
        check_bearer(request, self.api_key)
        raw = await request.body(config.max_body_bytes)
        original = parse_json_object(raw, orjson.loads)
        checked = check(original)
        if checked.client_rid and log.isEnabledFor(logging.INFO):
            log.info("client id", extra={"request_id": request_id, "client_rid": checked.client_rid})
        hint = RequestHint(checked.hint)
        tried: set[str] = set()
        for attempt in range(config.max_attempts):
            prefill, decode = self.choose_pair(hint, tried)
            check_token_ids(checked, pair_limits(prefill, decode))
            body = original if attempt == 0 else orjson.loads(raw)  # a fresh copy: attempt 0 may have changed it
            rids = inject_pd_fields(body, prefill, checked.batch_size)
            if log.isEnabledFor(logging.INFO):
                log.info("dispatch", extra={"request_id": request_id, "route": route, "attempt": attempt,
                                            "prefill": prefill.url, "decode": decode.url, "stream": checked.stream,
                                            "rids": rids})
            exchange = Exchange(prefill, decode, route, rids, checked.stream, {"x-request-id": request_id},
                                request_id, merge_logprobs=route == "/generate" and wants_logprobs(original),
                                deadline=started + config.total_timeout, total_timeout=config.total_timeout,
                                first_token_timeout=config.first_token_timeout)
            prefill.breaker.on_attempt()
            decode.breaker.on_attempt()
            try:
                answer = await self.dispatcher.forward(exchange, body)
            except HalfFailed as failure:
                self.dispatcher.on_failure(failure)
                log.warning("attempt failed", extra={"request_id": request_id, "attempt": attempt,
                                                     "error": failure.message, "detail": failure.detail,
                                                     "retryable": failure.retryable})
                if not failure.retryable or attempt + 1 == config.max_attempts:
                    return failure.answer()
                tried.add(failure.worker.worker_id)
                self.metrics.retries.labels(route).inc()
                await asyncio.sleep(config.retry_backoff * (2**attempt) * (0.5 + random.random()))
                continue
            finally:
                prefill.breaker.on_end()
                decode.breaker.on_end()
            prefill.breaker.on_success()
            decode.breaker.on_success()
            if config.expose_worker_ids:
                answer.headers["x-pdcluster-prefill"] = prefill.worker_id
                answer.headers["x-pdcluster-decode"] = decode.worker_id
            return answer
        raise AssertionError("unreachable: the last attempt returns")


def pair_limits(prefill: Worker, decode: Worker) -> ModelLimits:
    """What both halves can take (the smaller of what each registered)."""
    vocab = [w.vocab_size for w in (prefill, decode) if w.vocab_size is not None]
    context = [w.context_length for w in (prefill, decode) if w.context_length is not None]
    return ModelLimits(min(vocab) if vocab else None, min(context) if context else None)
