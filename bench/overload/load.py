"""bench.overload's load: open-loop Poisson arrivals of a prompt/answer mix at `/v1/completions` (streamed), per
sender (a tenant's key at its own rate), and the closed-loop probe that measures the cluster's capacity.

Every fourth arrival of a sender goes through the official openai client (`max_retries` as the run says), which
retries a 429 after its `Retry-After` by itself: its record keeps how many answers it got before the last (its
attempts) and whether it was served. The others are plain httpx requests, tried once, whose record keeps the status,
the time to the refusal or to the first and last streamed chunk.

Prompts are random words, each one token of the model's vocabulary (so that a prompt of n words is about n tokens,
and each its own: no radix cache turns a prefill into a hit), as text: SGLang's gateway refuses token ids in `prompt`.
`ignore_eos` makes every answer exactly its length: a request's mean inter-token latency is (last - first) / (n - 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

# (prompt tokens, answer tokens, share of arrivals): mostly short chat turns, some documents to summarise.
MIX = ((64, 96, 0.45), (256, 64, 0.40), (768, 32, 0.15))
OPENAI_EVERY = 4  # every 4th arrival of a sender goes through the openai client


@dataclass(frozen=True)
class Sender:
    """One tenant's arrivals in a phase: its API key (None: none sent), its label in the report, its rate."""
    label: str
    key: str | None
    rate: float  # arrivals per second


@dataclass
class Record:
    sender: str
    client: str  # "httpx" or "openai"
    prompt: int
    answer: int
    started: float
    status: int | None = None  # the last answer's status (200: admitted and streamed)
    first: float | None = None
    last: float | None = None
    ended: float | None = None
    chunks: int = 0
    completed: bool = False  # a finish_reason arrived
    error: str | None = None
    retry_after: str | None = None  # a refusal's header
    attempts: int = 0  # answers the openai client got (1 + its retries)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def words(model_dir: Path) -> list[str]:
    """The vocabulary's whole lowercase words of 3+ letters after a space (byte-level BPE's "Ġ"): one token each."""
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(t[1:] for t in vocab if t.startswith("\u0120") and len(t) > 3 and t[1:].isalpha() and t[1:].islower())


def body(model: str, prompt: int, answer: int, rng: random.Random, vocabulary: list[str]) -> dict:
    return {"model": model, "prompt": " ".join(rng.choices(vocabulary, k=prompt)), "max_tokens": answer,
            "temperature": 0, "stream": True, "ignore_eos": True}


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chunk(rec: Record, line: str) -> bool:
    """One SSE line into the record; False once the stream is over."""
    if not line.startswith("data:"):
        return True
    data = line[5:].strip()
    if data == "[DONE]":
        return False
    event = json.loads(data)
    if "error" in event:
        rec.error = f"stream error: {str(event['error'])[:160]}"
        return False
    for choice in event.get("choices") or []:
        now = time.monotonic()
        rec.first = rec.first or now
        rec.last, rec.chunks = now, rec.chunks + 1
        rec.completed = rec.completed or bool(choice.get("finish_reason"))
    return True


@contextlib.contextmanager
def recording(rec: Record, errors: type[Exception] | tuple[type[Exception], ...]) -> Iterator[None]:
    """A request's end, however it ends: the client's errors and the drain's cancellation noted in `rec`."""
    try:
        yield
    except errors as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:
        rec.error = "cancelled at the end of the drain"
        raise
    finally:
        rec.ended = time.monotonic()


async def send_httpx(client: httpx.AsyncClient, key: str | None, payload: dict, rec: Record) -> None:
    with recording(rec, httpx.HTTPError):
        async with client.stream("POST", "/v1/completions", json=payload, headers=_headers(key)) as response:
            rec.status = response.status_code
            if response.status_code != 200:
                rec.error = f"HTTP {response.status_code}: {(await response.aread())[:160]!r}"
                rec.retry_after = response.headers.get("retry-after")
                return
            async for line in response.aiter_lines():
                if not _chunk(rec, line):
                    break
        if not rec.error and not rec.completed:
            rec.error = f"stream ended after {rec.chunks} chunks without a finish_reason"


async def send_openai(base_url: str, key: str | None, payload: dict, rec: Record, max_retries: int) -> None:
    import openai  # imported on first use: the report's tests need no client

    async def count(response: httpx.Response) -> None:
        rec.attempts += 1
        rec.status = response.status_code
        rec.retry_after = response.headers.get("retry-after") or rec.retry_after

    http = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), event_hooks={"response": [count]})
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key or "none", max_retries=max_retries,
                                http_client=http)
    extra = {"ignore_eos": True}
    try:
        with recording(rec, openai.APIError):
            await _stream_openai(client, payload, extra, rec)
    finally:
        await client.close()


async def _stream_openai(client, payload: dict, extra: dict, rec: Record) -> None:
    stream = await client.completions.create(model=payload["model"], prompt=payload["prompt"],
                                             max_tokens=payload["max_tokens"], temperature=0, stream=True,
                                             extra_body=extra)
    async for event in stream:
        now = time.monotonic()
        rec.first = rec.first or now
        rec.last, rec.chunks = now, rec.chunks + 1
        rec.completed = rec.completed or any(c.finish_reason for c in event.choices)
    if not rec.completed:
        rec.error = f"stream ended after {rec.chunks} chunks without a finish_reason"


async def run_phase(url: str, model: str, vocabulary: list[str], senders: list[Sender], duration: float,
                    drain: float, seed: int, max_retries: int) -> tuple[list[Record], float, float]:
    """Each sender's Poisson arrivals for `duration` s from t0; what is in flight at t1 gets `drain` s, then is
    cancelled (its record says so)."""
    records: list[Record] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    t0 = time.monotonic()
    t1 = t0 + duration
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        tasks: list[asyncio.Task] = []

        async def arrivals(sender: Sender, rng: random.Random) -> None:
            at, n = t0, 0
            while True:
                at += rng.expovariate(sender.rate)
                if at >= t1:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                prompt, answer, _ = rng.choices(MIX, weights=[m[2] for m in MIX])[0]
                payload = body(model, prompt, answer, rng, vocabulary)
                use_openai = n % OPENAI_EVERY == OPENAI_EVERY - 1
                rec = Record(sender.label, "openai" if use_openai else "httpx", prompt, answer, time.monotonic())
                records.append(rec)
                send = (send_openai(url, sender.key, payload, rec, max_retries) if use_openai
                        else send_httpx(client, sender.key, payload, rec))
                tasks.append(asyncio.create_task(send))
                n += 1

        await asyncio.gather(*(arrivals(s, random.Random(seed * 1000 + i)) for i, s in enumerate(senders)))
        await asyncio.sleep(max(0.0, t1 - time.monotonic()))
        _, pending = await asyncio.wait(tasks, timeout=drain) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, t0, t1


async def probe(url: str, model: str, vocabulary: list[str], concurrency: int, warmup: float, duration: float,
                seed: int) -> dict:
    """`concurrency` closed-loop clients of the mix for `warmup` + `duration` s: the requests that ended in the last
    `duration` s, per second, are the cluster's capacity for this mix (the warm-up fills the pipeline first)."""
    rng, records = random.Random(seed), []
    start = time.monotonic()
    t0, t1 = start + warmup, start + warmup + duration
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as client:
        async def loop() -> None:
            while time.monotonic() < t1:
                prompt, answer, _ = rng.choices(MIX, weights=[m[2] for m in MIX])[0]
                rec = Record("probe", "httpx", prompt, answer, time.monotonic())
                records.append(rec)
                await send_httpx(client, None, body(model, prompt, answer, rng, vocabulary), rec)
                if rec.error:
                    await asyncio.sleep(0.5)  # do not spin on a target that refuses

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    done = [r for r in records if not r.error and r.ended is not None and t0 <= r.ended <= t1]
    errors = [r for r in records if r.error]
    return {"concurrency": concurrency, "warmup_s": warmup, "window_s": duration, "completed": len(done),
            "requests_per_s": round(len(done) / duration, 4), "errors": len(errors),
            "error_samples": sorted({r.error or "" for r in errors})[:3]}
