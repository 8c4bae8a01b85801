"""bench.pd's load: K closed-loop clients streaming long answers from short prompts, long prompts at a steady rate,
and open-loop probes: a short prompt every `probe_period` s, sent at its time whatever is running.

The probes are what a short prompt's TTFT is judged by: the streams' own requests are a closed loop, so in a
colocated server, where a long prompt's prefill stops every stream, no stream ends and no stream request arrives
while one runs; a probe arrives whenever its time comes.

Every request goes to SGLang's native `/generate` with `"stream": true` (through our router in PD mode), as token
ids drawn at random (each prompt its own, so that no radix cache turns a prefill into a hit). A request's record
keeps the time of each streamed chunk and its `meta_info.completion_tokens`, so inter-token latency (ITL) is per
token: a chunk that brings n tokens after a gap of g seconds counts as n gaps of g / n. The summary keeps what falls
in the measured window [t0, t1] (after a warm-up of the same load); in-flight requests may finish after it (drain).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class Shape:
    streams: int = 4  # closed-loop clients, one stream each in flight
    stream_tokens: int = 96
    short_len: int = 32  # prompt tokens of a stream's request
    long_len: int = 2000
    long_tokens: int = 4
    vocab: int = 49152
    probe_period: float | None = 1.5  # seconds between open-loop short prompts (None: none)
    probe_tokens: int = 4


@dataclass
class Record:
    kind: str  # "stream" | "long" | "probe"
    started: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, completion_tokens so far)
    ended: float | None = None
    error: str | None = None

    @property
    def first(self) -> float | None:
        return next((t for t, n in self.chunks if n > 0), None)

    def gaps(self) -> list[tuple[float, float]]:
        """(time of the chunk, seconds per token since the chunk before), once per token after the first."""
        out, (prev_t, prev_n) = [], (None, 0)
        for t, n in self.chunks:
            if prev_t is not None and n > prev_n > 0:
                out += [(t, (t - prev_t) / (n - prev_n))] * (n - prev_n)
            if n > prev_n:
                prev_t, prev_n = t, n
        return out


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


async def _one(client: httpx.AsyncClient, ids: list[int], new_tokens: int, rec: Record) -> None:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                rec.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    rec.error = str(data["error"])[:200]
                    return
                rec.chunks.append((time.monotonic(), int(data["meta_info"]["completion_tokens"])))
        if not rec.chunks or rec.chunks[-1][1] != new_tokens:
            rec.error = f"ended after {rec.chunks[-1][1] if rec.chunks else 0} of {new_tokens} tokens"
    except (httpx.HTTPError, asyncio.CancelledError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        rec.ended = time.monotonic()


async def run_cell(url: str, shape: Shape, period: float | None, warmup: float, duration: float, drain: float,
                   seed: int) -> tuple[list[Record], float, float]:
    """Warm-up, then `duration` s measured (t0..t1); nothing new starts after t1, what is in flight gets `drain` s
    to finish, and the rest is cancelled (its record says so). Long prompts every `period` s (None: none)."""
    rng, records = random.Random(seed), []
    start = time.monotonic()
    t0, t1 = start + warmup, start + warmup + duration
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900, connect=10), limits=limits) as client:
        async def streamer() -> None:
            while time.monotonic() < t1:
                rec = Record("stream", time.monotonic())
                records.append(rec)
                await _one(client, _ids(rng, shape.short_len, shape.vocab), shape.stream_tokens, rec)
                if rec.error:
                    await asyncio.sleep(0.5)  # do not spin on a target that refuses

        async def open_loop(kind: str, first: float, every: float | None, length: int, new_tokens: int,
                            tasks: list) -> None:
            """A request of `kind` every `every` s from `first` s after the start, whatever is running."""
            k = 0
            while every:
                at = start + first + k * every
                if at >= t1:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                rec = Record(kind, time.monotonic())
                records.append(rec)
                tasks.append(asyncio.create_task(_one(client, _ids(rng, length, shape.vocab), new_tokens, rec)))
                k += 1

        tasks: list[asyncio.Task] = [asyncio.create_task(streamer()) for _ in range(shape.streams)]
        # Probes are offset from the long prompts' times, so that they land at every point of a long prefill.
        await asyncio.gather(open_loop("long", 1.0, period, shape.long_len, shape.long_tokens, tasks),
                             open_loop("probe", 1.5, shape.probe_period, shape.short_len, shape.probe_tokens, tasks))
        await asyncio.sleep(max(0.0, t1 - time.monotonic()))
        _, pending = await asyncio.wait(tasks, timeout=drain)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, t0, t1


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _ms(values: list[float], qs=(50, 99)) -> dict:
    out = {f"p{q}": None if pct(values, q) is None else round(1000 * pct(values, q), 1) for q in qs}
    out["max"] = round(1000 * max(values), 1) if values else None
    out["n"] = len(values)
    return out


def summarize(records: list[Record], t0: float, t1: float) -> dict:
    """The window's numbers: ITL of the streams (tokens received in the window), TTFT of requests started in it,
    output tokens/s, and each stream completed in it with its own ITL p99 (the report's goodput needs the mode's
    idle ITL, known only once every cell ran)."""
    streams = [r for r in records if r.kind == "stream"]
    longs = [r for r in records if r.kind == "long" and t0 <= r.started < t1]
    itl = [g for r in streams for t, g in r.gaps() if t0 <= t < t1]
    tokens = sum(n1 - n0 for r in records
                 for (_, n0), (t, n1) in zip([(0, 0), *r.chunks], r.chunks, strict=False) if t0 <= t < t1)
    chunk_tokens = [n1 - n0 for r in streams for (_, n0), (_, n1) in zip(r.chunks, r.chunks[1:], strict=False)]
    done = [r for r in streams if not r.error and r.ended is not None and t0 <= r.ended < t1]
    ttft_short = [r.first - r.started for r in streams if t0 <= r.started < t1 and r.first is not None]
    ttft_long = [r.first - r.started for r in longs if r.first is not None]
    probes = [r for r in records if r.kind == "probe" and t0 <= r.started < t1]
    ttft_probe = [r.first - r.started for r in probes if r.first is not None]
    return {
        "window_s": round(t1 - t0, 2),
        "itl_ms": _ms(itl), "ttft_short_ms": _ms(ttft_short), "ttft_long_ms": _ms(ttft_long),
        "ttft_probe_ms": _ms(ttft_probe), "probes_sent": len(probes),
        "probes_unanswered": sum(1 for r in probes if r.first is None),
        "output_tokens_per_s": round(tokens / (t1 - t0), 2),
        "streams_completed": len(done), "streams_per_s": round(len(done) / (t1 - t0), 4),
        "stream_itl_p99_ms": [round(1000 * pct([g for _, g in r.gaps()], 99), 1) for r in done if r.gaps()],
        "long_sent": len(longs), "long_unanswered": sum(1 for r in longs if r.first is None),
        "errors": sum(1 for r in records if r.error and not r.error.startswith("CancelledError")),
        "cancelled_at_drain_end": sum(1 for r in records if r.error and r.error.startswith("CancelledError")),
        "error_samples": sorted({r.error for r in records if r.error})[:3],
        "tokens_per_chunk_mean": round(statistics.mean(chunk_tokens), 3) if chunk_tokens else None,
    }
