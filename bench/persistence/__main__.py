"""`python -m bench.persistence`: what the KV store on disk saves, with pdcluster's CPU attention on and off. Time to
first token (TTFT) of a long prompt through the router of a real local cluster (1 prefill + 1 decode), at several
prompt lengths:

  cold     the first time: the prefill computes the whole prompt (SGLang chunks it past its chunked-prefill size);
  storage  the same prompt after the prefill was restarted (SIGTERM, start): its pages read from the KV directory,
           which the page cache still holds (a restart, not a reboot);
  disk     the same, with the namespace's files first dropped from the page cache (posix_fadvise DONTNEED on those
           files only) and the prefill's memory tiers emptied (/flush_cache): every byte read from the device;
  memory   the same prompt again on the running prefill: its device KV cache, the best any cache can do;
  (storage and disk also record the seconds the prefill spent reading and verifying the pages' seals: verify_s)
  chat     a conversation's next turn (a prompt, its 128-token answer, 64 new tokens) against its first: the prompt
           from the prefill's memory, the answer from the pages the decode wrote; the first turn's inter-token
           latencies (ITL) are the decode's.

pdcluster/plugins/cpu_attention (cluster.cpu_attention) is the variable: two clusters run side by side, the same but for
it (on in one, off in the other), and every measurement alternates between them (which goes first alternates too),
with the same prompt, so each on/off pair is taken a few seconds apart on the same machine load. In this process, at
the end: the attention alone (bench/cpu_attention/extend.py), SGLang's and pdcluster's, for the longest prompt's
extends.

Models: one of bench.persistence.cluster.SHAPES built once into models/persistence-bench-<shape>, or `--shape smollm2`:
SmolLM2-135M-Instruct as `make setup` fetched it (a real model; its context holds 8192 tokens, so its longest prompt
is 8000). Writes bench/results/persistence.json and .png (default shape), or persistence-<shape>.json and .png. Run
it under the cluster lock (Makefile).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import httpx

from bench.cpu_attention import extend
from bench.harness.paths import REPO, RESULTS
from bench.persistence import report
from bench.persistence.cluster import (
    PAGE,
    SHAPES,
    WORK,
    Side,
    build_model,
    busy_cores,
    drop_from_page_cache,
    model_info,
    read_bandwidth,
    settle,
)

DEFAULT_SHAPE = "8b-balance"
LENGTHS = (1024, 2048, 4096, 8192)
REAL, SMOLLM2 = "smollm2", "models/smollm2-135m-instruct"  # --shape smollm2: the real model, not one of SHAPES
REAL_LENGTHS = (1024, 2048, 4096, 8000)  # SmolLM2's context is 8192 tokens: the prompt and its one new token fit
SERIES = ("cold", "storage", "disk", "memory")
MODES = ("on", "off")
CHAT_ANSWER, CHAT_NEXT = 128, 64


def prompt(tag: str, length: int, vocab: int) -> list[int]:
    rng = random.Random(tag)  # another tag, another first page: nothing of it is stored yet
    return [0] + [rng.randrange(4, vocab) for _ in range(length - 1)]


def ttft(client: httpx.Client, ids: list[int]) -> dict:
    """One request with max_new_tokens=1, not streamed: its latency is the time to the first token as the client sees
    it through the router (prefill, KV transfer to the decode, the decode's answer)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    started = time.perf_counter()
    response = client.post("/generate", json=body)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    meta = response.json()["meta_info"]
    tiers = meta.get("cached_tokens_details") or {}
    return {"seconds": round(seconds, 4), "cached_tokens": meta.get("cached_tokens", 0),
            "storage": int(tiers.get("storage") or 0), "device": int(tiers.get("device") or 0)}


def streamed(client: httpx.Client, ids: list[int], max_new: int) -> tuple[float, list[float], list[int]]:
    """A streamed greedy answer of max_new tokens: TTFT, the gap before each later token (seconds), the tokens."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    started, first, last, itl, out, count = time.perf_counter(), None, 0.0, [], [], 0
    with client.stream("POST", "/generate", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event, now = json.loads(line[6:]), time.perf_counter()
            tokens = event["meta_info"]["completion_tokens"]
            if tokens <= count:
                continue  # SGLang opens a stream before its first token
            new_ids = event.get("output_ids") or []
            out = list(new_ids) if len(new_ids) == tokens else out + list(new_ids)  # cumulative or incremental
            if first is None:
                first = now - started
            else:
                itl += [(now - last) / (tokens - count)] * (tokens - count)
            last, count = now, tokens
    return round(first, 4), [round(x, 5) for x in itl], out


def chat(side: Side, ids: list[int], tag: str, vocab: int) -> dict:
    side.wait_healthy()
    turn1_ttft, itl, answer = streamed(side.client, ids, CHAT_ANSWER)
    settle([side.kv])  # the decode writes each page of the answer as it completes, the last one just after the answer
    turn2 = ids + answer + prompt(f"{tag}-next", CHAT_NEXT + 1, vocab)[1:]
    side.wait_healthy()
    second = ttft(side.client, turn2)
    result = {"prompt_tokens": len(ids), "turn1_ttft_s": turn1_ttft, "turn2_prompt_tokens": len(turn2),
              "turn2_ttft_s": second["seconds"], "turn2_cached_tokens": second["cached_tokens"],
              "turn2_storage": second["storage"], "itl_s": itl}
    print(f"bench: {side.mode:3s} chat {({k: v for k, v in result.items() if k != 'itl_s'})}", flush=True)
    return result


def store_clock(side: Side) -> dict[str, float]:
    """The prefill's sealed-storage counters (pdcluster/kvstore/metrics.py): pages read from disk, the seconds reading
    them took, and of those the seconds checking their seals: the verification's cost, measured where it is paid."""
    names = {"pdcluster_kv_store_read_pages_total": "read_pages", "pdcluster_kv_store_read_seconds_total": "read_s",
             "pdcluster_kv_store_verify_seconds_total": "verify_s"}
    values = dict.fromkeys(names.values(), 0.0)
    for line in httpx.get(f"{side.prefill_url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[names[name]] = float(value)
    return values


def measure(side: Side, series: str, ids: list[int]) -> dict:
    side.wait_healthy()
    busy = busy_cores()
    before = store_clock(side) if series in ("storage", "disk") else None
    sample = {**ttft(side.client, ids), "busy_cores_before": busy}
    if before is not None:
        sample.update({key: round(value - before[key], 4) for key, value in store_clock(side).items()})
    print(f"bench: {side.mode:3s} {len(ids):5d} tokens {series:7s} {sample}", flush=True)
    return sample


def repeat(sides: dict[str, Side], rep: int, prompts: dict[int, list[int]], chat_ids: list[int], vocab: int,
           samples: dict, restarts: list) -> None:
    """Every series once in each mode, alternating request by request (the first mode alternating too)."""
    turn = [rep % 2]

    def modes() -> tuple[str, ...]:
        turn[0] += 1
        return MODES if turn[0] % 2 else MODES[::-1]

    for n, ids in prompts.items():
        for mode in modes():
            samples[mode]["cold"][n].append(measure(sides[mode], "cold", ids))
    for mode in modes():
        samples[mode]["chat"].append(chat(sides[mode], chat_ids, f"rep{rep}", vocab))
    settle([side.kv for side in sides.values()])
    for mode in modes():
        restarts.append(sides[mode].restart_prefill())
        ttft(sides[mode].client, prompt(f"warm-up-{rep}", 256, vocab))  # the restarted prefill's first-request costs
    for series in ("storage", "memory"):
        for n, ids in prompts.items():
            for mode in modes():
                samples[mode][series][n].append(measure(sides[mode], series, ids))
    for n, ids in prompts.items():
        for mode in modes():
            sides[mode].flush_memory_tiers()
            drop_from_page_cache(sides[mode].namespace_files())
            samples[mode]["disk"][n].append(measure(sides[mode], "disk", ids))


def run(path: Path, name: str, lengths: tuple[int, ...], repeats: int) -> dict:
    # SGLang's backend is imported now, not after half an hour of measurements (bench/cpu_attention/extend.py needs
    # it): the shared virtualenv can be reinstalled meanwhile, which once left this process unable to import it at the
    # end.
    import sglang.srt.layers.attention.torch_native_backend  # noqa: F401

    info = {"name": name, **model_info(path, lengths[-1])}
    vocab, positions = info["vocab_size"], info["max_positions"]
    # The chat's first turn is the longest prompt that leaves room for the answer and the next turn; when every
    # length is too long for that (`--lengths 8000` on SmolLM2), half the context, as the full run's 4096 there.
    chat_len = max((n for n in lengths if n + CHAT_ANSWER + CHAT_NEXT < positions), default=positions // 2)
    shutil.rmtree(WORK, ignore_errors=True)
    sides = {mode: Side(path, mode) for mode in MODES}
    print(f"bench: starting two clusters, cpu_attention on and off (logs in {WORK}/<mode>/logs) ...", flush=True)
    samples = {m: {**{s: {n: [] for n in lengths} for s in SERIES}, "chat": []} for m in MODES}
    restarts: list[float] = []
    try:
        for side in sides.values():
            side.start()
            side.check_pool(max(lengths[-1], chat_len + CHAT_ANSWER + CHAT_NEXT))
            ttft(side.client, prompt("warm-up", 256, vocab))  # first-request costs (allocators, lazy imports)
        server = sides["on"].server_info()
        for rep in range(repeats):
            prompts = {n: prompt(f"rep{rep}-len{n}", n, vocab) for n in lengths}
            repeat(sides, rep, prompts, prompt(f"rep{rep}-chat", chat_len, vocab), vocab, samples, restarts)
        settle([side.kv for side in sides.values()])
        (WORK / "samples.json").write_text(json.dumps({"server": server, "samples": samples, "restarts": restarts}))
        files = sides["on"].namespace_files()
        bandwidth = read_bandwidth(files)
        page_bytes = sorted(p.stat().st_size for p in files)[len(files) // 2]
    finally:
        for side in sides.values():
            side.stop()
            shutil.rmtree(side.kv, ignore_errors=True)  # hundreds of MB of pages; the logs stay
    chunk = server.get("chunked_prefill_size") or lengths[-1]
    print("bench: timing the attention alone ...", flush=True)
    op = extend.measure(info["dims"], lengths[-1], chunk, (lengths[-1] - 1) // PAGE * PAGE)
    return report.report(info, server, lengths, repeats, samples, restarts, bandwidth, page_bytes, op)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.persistence", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted([*SHAPES, REAL]), default=DEFAULT_SHAPE,
                        help=f"a random-weight model of that shape, or {REAL}: the real model make setup fetches")
    parser.add_argument("--lengths", help=f"prompt lengths in tokens (default {','.join(map(str, LENGTHS))}; "
                                          f"{REAL}: {','.join(map(str, REAL_LENGTHS))})")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="default: bench/results/persistence.json, or persistence-<shape>.json")
    args = parser.parse_args(argv)
    default = REAL_LENGTHS if args.shape == REAL else LENGTHS
    lengths = tuple(sorted(int(n) for n in args.lengths.split(","))) if args.lengths else default
    if args.shape == REAL:
        path = REPO / SMOLLM2
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path} is missing: `make setup` fetches it (scripts/fetch_smollm2.py)")
    else:
        path = build_model(args.shape)
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    if lengths[-1] + 1 > positions:
        parser.error(f"the longest prompt must leave room for one token within {positions}")
    name = args.shape
    stem = "persistence" if name == DEFAULT_SHAPE else f"persistence-{name}"
    out = Path(args.out) if args.out else RESULTS / f"{stem}.json"
    if out.suffix != ".json":  # `--out bench/results/x` as bench.pd takes it: x.json and x.png
        out = out.with_name(out.name + ".json")
    result = run(path, name, lengths, args.repeats)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    report.plot(result, out.with_suffix(".png"))
    report.summary(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
