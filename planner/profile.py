"""`make profile` (`python -m planner.profile --model <dir> --out configs/profiles/<name>.json`): measure this
machine's model into the capacity profile (pdcluster/common/capacity.py) that the planner and its simulator read.

It starts a real local cluster through the launcher behind `make up` (pdcluster.local: the bootstrap service, one
prefill, one decode and the router, on ports of its own) and measures through the router, as a client sees it:
- prefill: the time to first token of single requests (random token ids, nothing else running) at each prompt
  length, a few repeats each; tokens/s = length / median TTFT, the repeats' range kept as the spread;
- decode: `batch` concurrent streams at each context length, their per-token gaps while all of them run (medians and
  quartiles). The streams of one context share a prefix the prefill has cached, so that each costs the prefill a few
  tokens and they start nearly together; a batch the decode's KV pool cannot hold at once is skipped.
A budget keeps the run short on a shared machine: past it, the remaining points are skipped and the profile's
`method` names them, as it names a point whose requests failed (on a busy CPU a 4096-token prompt can outlast the
decode's 60 s wait for its KV, SGLANG_DISAGGREGATION_WAITING_TIMEOUT in configs/decode.yaml). Hold
`flock /tmp/pdcluster-cluster.lock` (the Makefile target does): one real cluster at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from pdcluster.common.capacity import DecodePoint, PrefillPoint, Profile
from pdcluster.local.cluster import LocalCluster
from pdcluster.local.models import SMOLLM2, model_args
from pdcluster.local.spec import ComponentSpec, LocalSpec, WorkerGroupSpec
from planner.measurements import Chunk, decode_point, fits_in_kv, prefill_point

# 26xxx: away from the tests (18xxx/28xxx/31xxx), the benchmarks (27xxx, 29xxx) and tests/chaos (38xxx).
PORTS = {"router": 26000, "bootstrap": 26998, "prefill": 26100, "kv_bootstrap": 26300, "decode": 26200,
         "kv_events": 26400}
SUFFIX_TOKENS = 16  # each decode stream's own tokens after its context's shared prefix


def start_cluster(model: str, log_dir: Path) -> LocalCluster:
    """One prefill and one decode of `model` with configs/prefill.yaml and decode.yaml as they are, and a router."""
    group = {"args": model_args(model), "count": 1}
    spec = LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=PORTS["bootstrap"]),
        router=ComponentSpec(config="configs/router.yaml", port=PORTS["router"]),
        prefill=WorkerGroupSpec(config="configs/prefill.yaml", first_port=PORTS["prefill"],
                                first_kv_bootstrap_port=PORTS["kv_bootstrap"], first_kv_events_port=PORTS["kv_events"],
                                **group),
        decode=WorkerGroupSpec(config="configs/decode.yaml", first_port=PORTS["decode"], **group),
        ready_timeout=900)
    cluster = LocalCluster(spec, log_dir, report=lambda line: print(f"cluster: {line}", flush=True))
    cluster.start()
    return cluster


async def stream(client: httpx.AsyncClient, ids: list[int], new_tokens: int) -> tuple[float, list[Chunk]]:
    """One streamed /generate through the router: when it was sent and each chunk's (time, completion tokens)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    chunks: list[Chunk] = []
    sent = time.monotonic()
    async with client.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/generate answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise RuntimeError(f"/generate failed mid-stream: {str(data['error'])[:300]}")
            chunks.append((time.monotonic(), int(data["meta_info"]["completion_tokens"])))
    if not chunks or chunks[-1][1] != new_tokens:
        raise RuntimeError(f"/generate ended after {chunks[-1][1] if chunks else 0} of {new_tokens} tokens")
    return sent, chunks


class Sweep:
    """The requests of one profiling run: random prompts of the model's vocabulary, a clock against the budget, and
    what was skipped."""

    def __init__(self, client: httpx.AsyncClient, vocab: int, seed: int = 0):
        self.client, self.vocab, self.rng = client, vocab, random.Random(seed)
        self.skipped: list[str] = []

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(n)]

    async def ttft(self, prompt_tokens: int) -> float:
        # Two tokens, the first chunk's time: a one-token answer may arrive as its only, final chunk.
        sent, chunks = await stream(self.client, self.ids(prompt_tokens), 2)
        return next(t for t, n in chunks if n > 0) - sent

    async def prefill(self, lengths: list[int], repeats: int, until: float) -> list[PrefillPoint]:
        await self.ttft(64)  # warm-up, not recorded: the first request pays one-off costs
        points = []
        for length in sorted(lengths):
            if time.monotonic() > until:
                self.skipped.append(f"prefill {length} (over the budget)")
                continue
            try:
                ttfts = [await self.ttft(length) for _ in range(repeats)]
            except (RuntimeError, httpx.HTTPError) as exc:  # a longer prompt would fail the same way: stop here
                self.skipped.append(f"prefill {length} and longer ({str(exc)[:120]})")
                print(f"prefill {length:5d} tokens failed, longer ones skipped: {exc}", flush=True)
                break
            points.append(prefill_point(length, ttfts))
            print(f"prefill {length:5d} tokens: {points[-1].tokens_per_s:7.1f} tokens/s "
                  f"(TTFT {', '.join(f'{t:.2f}' for t in ttfts)} s)", flush=True)
        return points

    async def decode(self, contexts: list[int], batches: list[int], answer_tokens: int, kv_tokens: int | None,
                     until: float) -> list[DecodePoint]:
        points = []
        for context in sorted(contexts):
            prefix = self.ids(context - SUFFIX_TOKENS)
            await stream(self.client, prefix + self.ids(SUFFIX_TOKENS), 1)  # the prefill caches the prefix
            for batch in sorted(batches):
                if not fits_in_kv(batch, context, answer_tokens, kv_tokens):
                    self.skipped.append(f"decode batch {batch} at context {context} (over the KV pool)")
                    continue
                if time.monotonic() > until:
                    self.skipped.append(f"decode batch {batch} at context {context} (over the budget)")
                    continue
                try:
                    runs = await asyncio.gather(*(stream(self.client, prefix + self.ids(SUFFIX_TOKENS), answer_tokens)
                                                  for _ in range(batch)))
                except (RuntimeError, httpx.HTTPError) as exc:
                    self.skipped.append(f"decode batch {batch} at context {context} ({str(exc)[:120]})")
                    continue
                # The context grows by the answer during the cell: the point is placed at its middle.
                point = decode_point(batch, context + answer_tokens // 2, [chunks for _, chunks in runs])
                if point is None:
                    self.skipped.append(f"decode batch {batch} at context {context} (the streams did not overlap)")
                    continue
                points.append(point)
                print(f"decode batch {batch:2d} context {context:5d}: ITL {1000 * point.itl_s:6.1f} ms "
                      f"(p75-p25 {1000 * point.spread:.1f} ms, {point.samples} gaps)", flush=True)
        return points


def hardware() -> str:
    """The CPU's name and core count, as /proc/cpuinfo and the OS say (what the numbers are true for)."""
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores seen by the OS, CPU only, shared with other work"


async def measure(args: argparse.Namespace, router_url: str, decode_url: str) -> Profile:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    kv_tokens = httpx.get(f"{decode_url}/server_info", timeout=30).json().get("max_total_num_tokens")
    started, load = time.monotonic(), os.getloadavg()  # the machine's other work, for whoever reads the noise
    timeout = httpx.Timeout(600, connect=10)
    async with httpx.AsyncClient(base_url=router_url, timeout=timeout) as client:
        sweep = Sweep(client, vocab)
        prefill = await sweep.prefill(args.prompt_lengths, args.repeats, started + args.prefill_budget_s)
        decode = await sweep.decode(args.contexts, args.batches, args.answer_tokens, kv_tokens,
                                    time.monotonic() + args.decode_budget_s)
    method = (f"planner.profile through pdcluster's router, 1 prefill + 1 decode (configs/prefill.yaml, decode.yaml); "
              f"prefill: median TTFT of {args.repeats} single requests of random ids per length, spread = range of "
              f"tokens/s; decode: median per-token gap of N concurrent streams of {args.answer_tokens} tokens while "
              f"all ran, spread = p75-p25; took {time.monotonic() - started:.0f} s, load average at the start "
              f"{', '.join(f'{x:.1f}' for x in load)}")
    if sweep.skipped:
        method += "; skipped: " + ", ".join(sweep.skipped)
    return Profile(model=Path(args.model).name, hardware=hardware(), measured_at=datetime.now(UTC), method=method,
                   prefill=tuple(prefill), decode=tuple(decode), flip_seconds=None, decode_kv_tokens=kv_tokens)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m planner.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SMOLLM2, help="a local Hugging Face checkpoint (default: %(default)s)")
    parser.add_argument("--out", help="the profile file (default: configs/profiles/<model folder name>.json)")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1536])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--prefill-budget-s", type=float, default=150.0)
    parser.add_argument("--decode-budget-s", type=float, default=150.0)
    parser.add_argument("--log-dir", default="logs/profile")
    args = parser.parse_args(argv)
    args.out = args.out or f"configs/profiles/{Path(args.model).name}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    began = time.monotonic()
    cluster = start_cluster(args.model, Path(args.log_dir).resolve())
    try:
        cluster.wait_ready()
        print(f"cluster ready in {time.monotonic() - began:.0f} s; measuring", flush=True)
        decode_url = f"http://127.0.0.1:{cluster.spec.decode.first_port}"
        profile = asyncio.run(measure(args, cluster.router_url, decode_url))
    finally:
        cluster.stop()
    profile.dump(args.out)
    print(f"wrote {args.out} ({len(profile.prefill)} prefill points, {len(profile.decode)} decode points) in "
          f"{time.monotonic() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
