"""The load bench.routing sends a router (and bench.routing.restarts, tests/unit/test_bench_routing.py): each request
streamed from /generate, timed to its first event, with its cached tokens and the prefill the router chose; a closed
loop of clients, or an open loop of Poisson arrivals; a chat's turn never before the turn it follows was answered."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from bench.routing.report import Shape

CONCURRENCY = 4  # requests in flight: more than one prefill keeps busy, so a policy's balance counts too
MAX_NEW_TOKENS = 8
QUICK = Shape(tenants=2, prefix_tokens=300, question_tokens=20, requests=12)


async def one(client: httpx.AsyncClient, url: str, text: str) -> dict:
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    start, ttft, last = time.perf_counter(), None, ""
    try:
        async with client.stream("POST", f"{url}/generate", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    last = line
            headers = response.headers
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    event = json.loads(last[5:]) if last else {}
    if ttft is None or "error" in event:
        return {"error": str(event.get("error") or "no event")[:200]}
    meta = event.get("meta_info") or {}
    predicted = headers.get("x-pdcluster-cached-tokens-predicted")
    return {"ttft_s": ttft, "seconds": time.perf_counter() - start, "cached_tokens": meta.get("cached_tokens") or 0,
            "storage_tokens": int((meta.get("cached_tokens_details") or {}).get("storage") or 0),
            "prompt_tokens": meta.get("prompt_tokens"), "prefill": headers.get("x-pdcluster-prefill"),
            "predicted": int(predicted) if predicted is not None else None}


async def drive(url: str, texts: list[str], concurrency: int, after: list[int | None] | None = None) -> list[dict]:
    """A closed loop: `concurrency` clients, each sending the workload's next request once its last one ended; a
    chat's turn (`after`: the request it follows) once the turn before it was answered, as a user sends it. Each
    answer keeps when it was sent (`sent_s`, from the loop's start): with its TTFT and seconds, the run's timeline
    (bench/routing/phases.py)."""
    answers: list[dict] = [{} for _ in texts]
    answered = [asyncio.Event() for _ in texts]
    pending = iter(enumerate(texts))
    async with httpx.AsyncClient(timeout=900) as client:
        began = time.perf_counter()

        async def client_loop() -> None:
            for i, text in pending:
                if after is not None and (before := after[i]) is not None:
                    await answered[before].wait()  # taken earlier, by a client that waits on nothing later
                sent = time.perf_counter() - began
                answers[i] = {**await one(client, url, text), "sent_s": sent}
                answered[i].set()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return answers


async def drive_open(url: str, texts: list[str], rate: float, after: list[int | None], seed: int) -> list[dict]:
    """An open loop: the workload's requests arrive as a Poisson process of `rate` a second (seeded: the same times
    for every policy), whatever is still unanswered; a chat's turn at its arrival or once the turn before it was
    answered, whichever is later. TTFT counts from when a request is sent."""
    clock, due = random.Random(seed), []
    for _ in texts:
        due.append((due[-1] if due else 0.0) + clock.expovariate(rate))
    answers: list[dict] = [{} for _ in texts]
    answered = [asyncio.Event() for _ in texts]
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=None)) as client:
        began = time.perf_counter()

        async def arrive(i: int, text: str) -> None:
            # the loop's clock is not perf_counter and may wake a hair early: sleep again until the arrival is due
            while (early := due[i] - (time.perf_counter() - began)) > 0:
                await asyncio.sleep(early)
            if (before := after[i]) is not None:
                await answered[before].wait()
            sent = time.perf_counter() - began
            answers[i] = {**await one(client, url, text), "sent_s": sent, "due_s": due[i]}
            answered[i].set()
        await asyncio.gather(*(arrive(i, text) for i, text in enumerate(texts)))
    return answers
