"""The router's contract, fuzzed against real SmolLM2 workers: schemathesis reads the router's own /openapi.json and
makes bodies that fit it (positive) and bodies that break it (negative), FUZZ_CASES per PD route (SHARE: fewer on
/v1/responses, rendered as a chat, and /v1/conversations, the router's store, as `make up` keeps it).

Every answer must: be no 5xx; be a documented status with a documented content type; fit its response schema; be a
4xx for a body the schema refuses; carry no traceback, path of the server's files or internal address. At the end
no worker may have restarted or lost a process. Cases are made first, then sent FUZZ_CLIENTS at a time, so that the
workers also meet them batched together, as they meet real traffic.

Generation is capped at a few tokens per request (`_few_tokens`): the fuzzer looks for what a worker cannot survive,
not for long answers, and 1,000 cases per route must fit the suite's time budget. The seed is printed; replay with
PDCLUSTER_FUZZ_SEED=<seed>. The hand-written hostile bodies (tests/e2e/test_fuzz.py) keep what a schema cannot say:
values at the pair's own limits (vocabulary and context length, +-1), grammars that are valid but ruinous.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e_smollm2.conftest import REPO
from tests.helpers import ROUTER_ERRORS, sglang_processes

FUZZ_CASES = int(os.environ.get("PDCLUSTER_FUZZ_CASES", "1000"))  # per route, POSITIVE of them fit the schema
# Cases that fit the schema reach both workers: ~1.5 s each on SmolLM2 in PD on two cores (the prefill's forward and
# the hand-off), so they are the budget; the rest are the router's 400s, milliseconds each.
POSITIVE = int(os.environ.get("PDCLUSTER_FUZZ_POSITIVE", "100"))
FUZZ_CLIENTS = 6
SEED = int(os.environ.get("PDCLUSTER_FUZZ_SEED") or random.SystemRandom().getrandbits(32))
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/conversations"]
# The share of the cases a route gets (CI's time is a shared budget): /v1/responses is rendered as a chat and meets
# the chat's checks after its own (1,000 cases took 56 s); /v1/conversations reaches no worker (the router's store
# alone), and 1,000 cases of it took 80 s.
SHARE = {"/v1/responses": 0.3, "/v1/conversations": 0.1}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
MAX_TOKENS = 4
MAX_ITEMS = 4  # of a batch: each item is a request of its own on both workers
WARM_UP = {"/generate": {"text": "Hello"}, "/v1/completions": {"prompt": "Hello"},
           "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}]},
           "/v1/responses": {"input": "Hello"}, "/v1/conversations": {"metadata": {"topic": "warm-up"}}}
_COUNTS = {"max_new_tokens", "min_new_tokens", "max_tokens", "min_tokens", "max_completion_tokens",
           "max_output_tokens"}
# Each route's own limit on the answer's tokens (a Responses request has only max_output_tokens).
LIMITS = {"/v1/completions": ("max_tokens",), "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
          "/v1/responses": ("max_output_tokens",)}
# What only the server should know: a traceback, a path of its files, an internal address (ip:port).
LEAK = re.compile("|".join([r"Traceback \(most recent", r'File "[^"]+", line', "site-packages", re.escape(str(REPO)),
                             r"\b\d{1,3}(?:\.\d{1,3}){3}:\d+"]))


def _few_tokens(value: Any) -> Any:
    """The body with every token count that asks for more than MAX_TOKENS lowered to it (where it is a valid one),
    and integers as JSON clients write them: JSON Schema counts 5.0 as an integer, the router's strict types do not
    (the contract says so), and a positive case should reach the workers."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        # Each value made an int first, then capped: 8000.0 capped after becoming 8000, never let through as 8000 (a
        # chat with ignore_eos then generates for minutes, and the router rightly answers 504 at first_byte_timeout).
        made = {k: _few_tokens(v) for k, v in value.items()}
        return {k: MAX_TOKENS if k in _COUNTS and type(v) is int and MAX_TOKENS < v <= 2**31 - 1 else v
                for k, v in made.items()}
    if isinstance(value, list):
        return [_few_tokens(v) for v in value]
    return value


def capped(route: str, body: Any) -> Any:
    """`body` asking for at most MAX_TOKENS per answer for at most MAX_ITEMS prompts: counts lowered, a limit added
    where it gives none (a chat without one generates up to the context length: minutes on a CPU), and a batch's
    lists (prompts, their sampling_params and rids) cut alike (a batch of 64 is 64 requests on both workers)."""
    body = _few_tokens(body)
    if not isinstance(body, dict):
        return body
    for key in ("text", "input_ids", "prompt", "sampling_params", "rid"):
        items = body.get(key)
        if isinstance(items, list) and len(items) > MAX_ITEMS:  # a single prompt's ids: only shorter
            body[key] = items[:MAX_ITEMS]
    if route != "/generate":
        limits = LIMITS.get(route, ())  # none: a route of the router's store, which no worker answers
        if limits and all(body.get(key) is None for key in limits):
            body[limits[0]] = MAX_TOKENS
        return body
    params = body.get("sampling_params")
    for one in params if isinstance(params, list) else [params]:
        if isinstance(one, dict) and one.get("max_new_tokens") is None:
            one["max_new_tokens"] = MAX_TOKENS
    if params is None:
        body["sampling_params"] = {"max_new_tokens": MAX_TOKENS}
    return body


def make_cases(operation, mode: GenerationMode, count: int, salt: int) -> list:
    cases: list = []

    @seed(SEED + salt)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def collect(case) -> None:
        cases.append(case)

    collect()
    return cases


def _as_json(body: Any) -> str:
    try:
        return json.dumps(body)[:20000]
    except (TypeError, ValueError):  # bytes in a negative case
        return repr(body)[:20000]


def problems_of(case, router_url: str, sessions: threading.local) -> str | None:
    case.body = capped(case.path, case.body)
    session = getattr(sessions, "session", None) or requests.Session()
    sessions.session = session
    try:
        response = case.call(base_url=router_url, session=session, timeout=300)
    except requests.RequestException as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        case.validate_response(response, checks=CHECKS)
    except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a group of the checks that failed
        return f"{response.status_code} {type(exc).__name__}: {str(exc)[:600]}"
    headers = {name: ", ".join(values) for name, values in response.headers.items()}  # schemathesis keeps lists
    seen = response.text + "".join(f"{k}: {v}\n" for k, v in headers.items())
    if leak := LEAK.search(seen):
        return f"{response.status_code}: the answer shows {leak.group(0)!r}: {seen[:300]}"
    if headers.get("content-type", "").startswith("text/event-stream"):
        errors = [line for line in response.text.splitlines() if line.startswith("data:") and '"error"' in line]
        if any(e in line for line in errors for e in ROUTER_ERRORS):
            return f"a stream failed: {errors[0][:300]}"
    return None


@pytest.mark.parametrize("route", ROUTES)
def test_the_contract_holds_on_real_workers(cluster, router, route):
    total = int(FUZZ_CASES * SHARE.get(route, 1))
    print(f"\nschema fuzz seed: {SEED} (replay: PDCLUSTER_FUZZ_SEED={SEED}), {total} cases on {route}")
    operation = schemathesis.openapi.from_dict(router.get("/openapi.json").json())[route]["POST"]
    positive = min(int(POSITIVE * SHARE.get(route, 1)), total)
    salt = ROUTES.index(route) * 2
    cases = [*make_cases(operation, GenerationMode.POSITIVE, positive, salt),
             *make_cases(operation, GenerationMode.NEGATIVE, total - positive, salt + 1)]
    # One ordinary request first: a cluster just started compiles and warms up on it, not under six fuzzing clients.
    assert router.post(route, json=capped(route, WARM_UP[route])).status_code == 200
    processes, restarts = sglang_processes(cluster), cluster.restarts()
    sessions = threading.local()
    def judged(case) -> str | None:
        problem = problems_of(case, cluster.router_url, sessions)
        if problem:
            print(f"found: {problem[:300]}\n    body: {_as_json(case.body)}", flush=True)  # whole: to replay it
        return problem

    with ThreadPoolExecutor(FUZZ_CLIENTS) as pool:
        found = [(case, problem) for case, problem in zip(cases, pool.map(judged, cases), strict=True) if problem]
    statuses: dict[str, int] = {}
    for case in cases:
        statuses[case.meta.generation.mode.value] = statuses.get(case.meta.generation.mode.value, 0) + 1
    print(f"sent {len(cases)} cases {statuses}")
    assert len(cases) >= total * 0.9, f"schemathesis made only {len(cases)} cases"  # it stops on no new ones
    assert not found, f"seed {SEED}: {len(found)} bad answers; the first:\n" + "\n".join(
        f"{problem}\n    body: {str(case.body)[:400]}" for case, problem in found[:5])
    assert cluster.restarts() == restarts
    assert sglang_processes(cluster) == processes, "a worker's SGLang processes changed: one crashed"
    ready = router.get("/ready").json()
    assert ready["ready"] and all(w["healthy"] for w in ready["workers"]), ready
