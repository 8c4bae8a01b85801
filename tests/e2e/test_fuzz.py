"""The trust boundary, fuzzed: hostile bodies generated from the inventory, through the router, to real workers.

Every body must get a 2xx or a JSON 4xx (a stream: no error event of the router's, which would mean a worker failed
it), nothing may hang, and no worker may die or restart during the run: their SGLang processes are the same at the
end, the local cluster restarted nothing, and every worker is healthy. Bounded: FUZZ_EXAMPLES bodies per route.

The seed is printed; replay a run with PDCLUSTER_FUZZ_SEED=<seed>. What a run finds becomes a plain regression
test in tests/e2e/test_trust_boundary.py (and a decision in router/checks/inventory/).

The schema-driven fuzzer (tests/e2e_smollm2/test_schema_fuzz.py) covers what the router's /openapi.json can say; this
one keeps what it cannot: values at the pair's own limits (its vocabulary and context length, +-1), refused fields
sent with hostile values, and grammars that are valid but ruinous.
"""

from __future__ import annotations

import json
import os
import random
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from tests.e2e.fuzz_bodies import BodyMaker
from tests.helpers import ROUTER_ERRORS, listing, sglang_processes

FUZZ_EXAMPLES = int(os.environ.get("PDCLUSTER_FUZZ_EXAMPLES", "120"))
SEED = int(os.environ.get("PDCLUSTER_FUZZ_SEED") or random.SystemRandom().getrandbits(32))
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]
TIMEOUT = 180  # seconds one request may take: the longest answer a fuzzed body can ask for is a few thousand tokens


def judge(route: str, body: dict, status: int, text: str) -> str | None:
    """What is wrong with this answer, or None."""
    if status >= 500:
        return f"{status}: {text[:300]}"
    if status >= 400:
        try:
            json.loads(text)
        except ValueError:
            return f"{status} without a JSON body: {text[:200]}"
        return None
    if body.get("stream") is True:
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        for event in events:
            if event != "[DONE]" and '"error"' in event and any(e in event for e in ROUTER_ERRORS):
                return f"stream failed: {event[:300]}"
        if not events:
            return f"an empty stream: {text[:200]}"
    return None


@pytest.fixture(scope="module")
def body_maker(cluster) -> BodyMaker:
    decode = listing(cluster, "decode")[0]["registration"]
    return BodyMaker(decode["vocab_size"], decode["context_length"], decode["identity"]["served_model_name"])


@pytest.mark.parametrize("route", ROUTES)
def test_no_body_takes_a_worker_down(cluster, router, body_maker, route):
    print(f"\nfuzz seed: {SEED} (replay: PDCLUSTER_FUZZ_SEED={SEED}), {FUZZ_EXAMPLES} bodies on {route}")
    processes, restarts = sglang_processes(cluster), cluster.restarts()
    found: list[str] = []
    sent = {"2xx": 0, "4xx": 0}

    @seed(SEED + ROUTES.index(route))
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(body=body_maker.body(route))
    def send(body: dict) -> None:
        started = time.monotonic()
        try:
            with httpx.stream("POST", f"{cluster.router_url}{route}", json=body, timeout=TIMEOUT) as response:
                text = response.read().decode(errors="replace")
                status = response.status_code
        except httpx.HTTPError as exc:
            found.append(f"{type(exc).__name__} after {time.monotonic() - started:.0f}s: {json.dumps(body)[:500]}")
            return
        kind = "2xx" if status < 300 else "4xx" if status < 500 else "5xx"
        sent[kind] = sent.get(kind, 0) + 1
        problem = judge(route, body, status, text)
        if problem:
            found.append(f"{problem}\n    body: {json.dumps(body)[:500]}")

    send()
    print(f"sent {sent}")
    assert not found, f"seed {SEED}: {len(found)} bad answers; the first:\n" + "\n".join(found[:5])
    assert cluster.restarts() == restarts
    assert sglang_processes(cluster) == processes, "a worker's SGLang processes changed: one crashed"
    ready = router.get("/ready").json()
    assert ready["ready"] and all(w["healthy"] for w in ready["workers"]), ready
