"""`python -m bench.openai.n_choices`: what OpenAI's `n` costs through PD. The time of a chat answer with n = 4 choices
against n = 1 on a ~1000-token prompt (SmolLM2-135M-Instruct, `make up`'s configs: 1 prefill, 1 decode), on one
cluster, the two alternating (which goes first alternates too), each time with a prompt the prefill has never seen
(a fresh random prefix), so that every measurement pays the prompt's prefill once. Every choice generates exactly
MAX_TOKENS tokens (ignore_eos), so n = 4 decodes 4x the tokens of n = 1 in one batch.

The router sends the first choice alone and the others, together, once its prefill half answered, to that prefill
(router/openai/fanout.py): the prefill's radix cache serves them the prompt. The target: n = 4 <= 1.5x n = 1.
Writes bench/results/n-choices.json and .png: each pair's ratio, the ratios' median and spread (the noise).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.harness.clusters import MODELS, start_cluster
from bench.harness.machine import machine
from bench.harness.paths import RESULTS
from bench.harness.plot import pyplot, save, stamp

WORK = Path("/tmp/pdcluster-bench-n-choices")
PROMPT_TOKENS = 1000  # about: words of a short vocabulary are a token each in SmolLM2's tokenizer
MAX_TOKENS = 16
WORDS = ("river", "stone", "light", "market", "window", "garden", "paper", "silver", "cloud", "engine")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_TOKENS - 20)) + "\nSummarise the text above."


def one(client: httpx.Client, url: str, served: str, text: str, n: int) -> dict:
    body = {"model": served, "messages": [{"role": "user", "content": text}], "n": n, "max_tokens": MAX_TOKENS,
            "temperature": 0.7, "ignore_eos": True}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    answer = response.json()
    assert len(answer["choices"]) == n, answer
    usage = answer["usage"]
    assert usage["completion_tokens"] == n * MAX_TOKENS, usage
    return {"n": n, "seconds": seconds, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.openai.n_choices")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args(argv)
    model = MODELS["smollm2"]
    cluster = start_cluster(model, prefills=1, sleep_on_idle=True, log_dir=WORK / "logs")
    rng = random.Random(37)
    pairs = []
    try:
        cluster.wait_ready(900)
        with httpx.Client(timeout=600) as client:
            one(client, cluster.router_url, model.served, prompt(rng), 1)  # warm-up: first forwards are slower
            for i in range(args.pairs):
                order = (1, args.n) if i % 2 == 0 else (args.n, 1)
                runs = {n: one(client, cluster.router_url, model.served, prompt(rng), n) for n in order}
                pairs.append({"first": order[0], "n1": runs[1], "nk": runs[args.n],
                              "ratio": runs[args.n]["seconds"] / runs[1]["seconds"]})
                print(f"pair {i}: n=1 {runs[1]['seconds']:.2f}s  n={args.n} {runs[args.n]['seconds']:.2f}s  "
                      f"ratio {pairs[-1]['ratio']:.2f}", flush=True)
    finally:
        cluster.stop()
    ratios = sorted(p["ratio"] for p in pairs)
    summary = {"n": args.n, "pairs": len(pairs), "ratio_median": statistics.median(ratios),
               "ratio_min": ratios[0], "ratio_max": ratios[-1],
               "ratio_stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0, "target": 1.5,
               "met": statistics.median(ratios) <= 1.5}
    result = {"machine": machine(), "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
              "summary": summary, "pairs": pairs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "n-choices.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "n-choices.png")
    print(json.dumps(summary, indent=2))
    return 0


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    n = result["summary"]["n"]
    left.plot([p["n1"]["seconds"] for p in result["pairs"]], "o-", label="n = 1")
    left.plot([p["nk"]["seconds"] for p in result["pairs"]], "s-", label=f"n = {n}")
    left.set(xlabel="pair", ylabel="seconds per answer", title=f"~{result['prompt_tokens']}-token prompt, "
             f"{result['max_tokens']} tokens per choice")
    left.legend()
    right.plot([p["ratio"] for p in result["pairs"]], "o")
    right.axhline(1.5, color="red", linestyle="--", label="target 1.5x")
    right.axhline(result["summary"]["ratio_median"], color="gray", label="median")
    right.set(xlabel="pair", ylabel=f"time n = {n} / n = 1", title="ratio per pair")
    right.legend()
    fig.suptitle(f"OpenAI n through PD, SmolLM2 ({stamp(result['machine'])})")
    save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
