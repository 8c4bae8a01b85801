"""`python -m bench.routing.decision` (`make bench-routing-decision`, ~1 min, no SGLang): what the cache_aware policy
costs the router, in its own process, on its real code. A harness, not a cluster: the model's real tokenizer and chat
template (SmolLM2's, from models/), and KV event batches made by SGLang 0.5.23's own classes in its wire form, but no
engine sends them.

- A decision: `CacheAware.choose_prefill` for a /generate text and a chat of about 1000 and 8000 tokens (counted:
  `tokens`), between two indexed prefills of which one holds the shared text as far as the router reads it (its
  first 32k characters, ~4.9k tokens: router/kv_routing/prompt_ids.py; page size 1, as SGLang on CPU publishes):
  rendering the chat, tokenizing as far as a prefill holds the prompt, walking the index, weighing load. Each prompt a
  shared text and a new question (a tenant's traffic), or a text never seen. Timed one by one in an event loop,
  p50/p99 over repeats (`ids_read`: the most a decision encoded; `cpu_p99_ms`: its CPU time's, which a busy machine's
  other processes do not inflate); `credit_p50_ms`: the routed prompt's rest, encoded in the loop's next turn, off the
  request's path (router/kv_routing/cache_aware.py). The target is every 8000-token prompt's p99.
- The event stream: `Subscription.receive` (decode, check the sequence, index) of BlockStored batches, as a prefill
  sends one per prompt it computed: CPU time per stored token, and the share of a core it costs at the routing
  benchmark's rate (the prompt tokens its prefills computed per second, from bench/results/routing.json), or at
  FALLBACK_RATE if that has not run.
Writes bench/results/routing-decision.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.harness.machine import machine
from bench.harness.paths import REPO, RESULTS
from bench.harness.plot import pyplot, save
from bench.routing.report import WORDS
from pdcluster.common.protocol import KVEventsEndpoint, ModelIdentity, Role
from router.checks.validation import check_chat, check_generate
from router.fleet.workers import Worker, WorkerPool
from router.kv_routing.cache_aware import CacheAware
from router.kv_routing.kv_events import Subscription
from router.kv_routing.kv_keys import LazyIds
from router.kv_routing.kv_routed import RoutedPrompts
from router.kv_routing.kv_wire import Stored
from router.metrics import RouterMetrics
from router.pd.policies import make_policy
from router.routing.policy import RoutingView

MODEL = "models/smollm2-135m-instruct"
TARGET_MS = 1.0  # the decision's p99 for an 8k-token prompt, shared or novel
SIZES = (1000, 8000)  # prompt tokens
QUESTION_WORDS = 40
TARGET_CORE = 0.05  # the event stream's share of a core at the benchmark's load
FALLBACK_RATE = 2000.0  # prompt tokens computed per second by both prefills, if routing.json is missing
ROUTING_JSON = RESULTS / "routing.json"
ROUTES = ("/generate", "/v1/chat/completions")


def text_of(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))  # about a token a word (bench/routing/report.py)


def request_of(route: str, text: str) -> RoutingView:
    """A /generate of `text`, or a chat of its part before " Question " as the system prompt and the rest (or, if
    none, its second half) as the user's: a tenant's chat shares its rendered system prompt."""
    if route == "/generate":
        body: dict = {"text": text, "sampling_params": {"max_new_tokens": 8}}
        checked = check_generate(body)
    else:
        cut = text.find(" Question ")
        cut = cut if cut >= 0 else len(text) // 2
        body = {"model": "m", "messages": [{"role": "system", "content": text[:cut]},
                                           {"role": "user", "content": text[cut + 1:]}]}
        checked = check_chat(body)
    return RoutingView(route, body, checked)


def policy_for(model_path: str) -> tuple[CacheAware, list[Worker]]:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    policy.metrics = RouterMetrics(WorkerPool())
    identity = ModelIdentity(model_path=model_path, served_model_name="m", page_size=1, kv_cache_dtype="auto",
                             transfer_backend="mooncake")
    workers = [Worker(f"p{i}", Role.PREFILL, f"http://p{i}", "h", 9000 + i, identity=identity) for i in range(2)]
    asyncio.run(policy.tokens.load(model_path))
    return policy, workers


def decision(policy: CacheAware, workers: list[Worker], route: str, tokens: int, novel: bool, repeats: int) -> dict:
    """`repeats` decisions on prompts of about `tokens` tokens: each a tenant's shared text and a new question of its
    own, or (`novel`) each a text of its own, the tokenizer's worst case."""
    model = workers[0].identity.model_path  # type: ignore[union-attr]
    decode = Worker("d0", Role.DECODE, "http://d0", identity=workers[0].identity)  # the pair's, chosen already
    shared = text_of(tokens - QUESTION_WORDS - 4, seed=tokens)  # a word a token, and the question's few more
    texts = [text_of(tokens, seed=tokens * 1000 + i) if novel else f"{shared} Question {i}: {text_of(40, seed=i)}?"
             for i in range(repeats)]
    ids = policy.tokens.of(request_of(route, f"{shared} Question 0: ?"), model)
    assert ids, "no ids: the tokenizer did not load"
    for worker in workers:  # p0 holds the shared text as far as the router reads it, p1 a short prefix
        held = len(ids) if worker.worker_id == "p0" else 16
        policy.index.open(worker.worker_id, 1).apply(
            Stored(tuple(range(1, held + 1)), None, tuple(ids[:held]), 1, "GPU"))
    policy.routed = RoutedPrompts()
    lazy = policy.tokens.lazy
    read: list[LazyIds] = []

    def reading(request: RoutingView, model_path: str | None) -> LazyIds | None:  # what a decision reads, kept
        read.append(found := lazy(request, model_path))  # type: ignore[arg-type]
        return found

    policy.tokens.lazy = reading  # type: ignore[method-assign]
    times, cpus, credits, reads = [], [], [], []
    encode = policy.tokens.tokenizers[model].tokenizer.encode  # type: ignore[union-attr]
    sizes = [len(encode(text).ids) for text in texts[:20]]  # counted apart: an 8 ms encode just before would time
    # its CPU caches' eviction, not the router's

    async def run() -> None:  # in an event loop, as the router: the routed credit's rest comes in its next turn
        for text in texts:
            request = request_of(route, text)
            start, cpu = time.perf_counter(), time.thread_time()
            chosen = policy.choose_prefill(decode, workers, request).prefill
            times.append(time.perf_counter() - start)
            cpus.append(time.thread_time() - cpu)
            last = read.pop()  # not kept: a router keeps no prompt's ids, and 300 kept would slow its GC's passes
            reads.append(len(last.ids) if last is not None else 0)
            start = time.perf_counter()
            await asyncio.sleep(0)
            credits.append(time.perf_counter() - start)
            assert novel or chosen.worker_id == "p0"

    try:
        asyncio.run(run())
    finally:
        policy.tokens.lazy = lazy  # type: ignore[method-assign]
    ms = sorted(t * 1000 for t in times)
    return {"route": route, "prompt": "novel" if novel else "shared prefix", "size": tokens,
            "tokens": round(statistics.median(sizes)),
            "ids_read": max(reads), "ids_held": len(ids), "repeats": repeats,
            "p50_ms": round(statistics.median(ms), 4), "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
            "max_ms": round(ms[-1], 4), "cpu_p99_ms": round(percentile(cpus, 0.99) * 1000, 4),
            "credit_p50_ms": round(statistics.median(credits) * 1000, 4)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def event_stream(prompt_tokens: int, batches: int) -> dict:
    import msgspec
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

    index_owner = make_policy("cache_aware")
    assert isinstance(index_owner, CacheAware)
    metrics = RouterMetrics(WorkerPool())
    identity = ModelIdentity(model_path="m", served_model_name="m", page_size=1, kv_cache_dtype="auto",
                             transfer_backend="mooncake")
    worker = Worker("p0", Role.PREFILL, "http://p0", "h", 9000, identity=identity)
    endpoint = KVEventsEndpoint(host="127.0.0.1", port=1)
    subscription = Subscription(None, worker, endpoint, index_owner.index, metrics)  # type: ignore[arg-type]
    index_owner.index.open("p0", 1)
    rng = random.Random(0)
    messages = []
    for sequence in range(batches):
        tokens = [rng.randrange(49152) for _ in range(prompt_tokens)]
        hashes = [rng.getrandbits(63) for _ in range(prompt_tokens)]
        event = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=1, lora_id=None,
                            medium="GPU")
        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[event]))
        messages.append([b"", sequence.to_bytes(8, "big"), payload])
    start = time.process_time()
    for message in messages:
        subscription.receive(message)
    cpu = time.process_time() - start
    per_token_us = cpu / (batches * prompt_tokens) * 1e6
    rate, source = FALLBACK_RATE, f"FALLBACK_RATE ({FALLBACK_RATE:g} tokens/s)"
    if ROUTING_JSON.exists():
        runs = [r for r in json.loads(ROUTING_JSON.read_text())["runs"] if r.get("computed_tokens_per_s")]
        if runs:
            rate = max(r["computed_tokens_per_s"] for r in runs)
            source = f"{ROUTING_JSON.name}: the fastest run's prompt tokens computed per second"
    return {"batches": batches, "tokens_per_batch": prompt_tokens, "cpu_us_per_token": round(per_token_us, 4),
            "tokens_per_s": round(rate, 1), "rate_from": source, "core_share": round(per_token_us * rate / 1e6, 5),
            "index_pages": index_owner.index.size("p0")}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing.decision", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    started = time.time()
    policy, workers = policy_for(str(REPO / MODEL))
    decisions = [decision(policy, workers, route, tokens, novel, args.repeats) for route in ROUTES
                 for tokens in SIZES for novel in (False, True)]
    events = event_stream(1000, 200)
    longest = [d for d in decisions if d["size"] == SIZES[-1]]
    verdict = {"decision_p99_ms_8k": max(d["p99_ms"] for d in longest), "decision_target_ms": TARGET_MS,
               "event_core_share": events["core_share"], "event_target_core_share": TARGET_CORE}
    verdict["met"] = verdict["decision_p99_ms_8k"] <= TARGET_MS and events["core_share"] <= TARGET_CORE
    result = {"benchmark": "cache_aware's decision and KV event stream, in the router's process (a harness: no "
                           "engine; SGLang's event classes, SmolLM2's tokenizer)",
              "machine": machine(), "wall_seconds": round(time.time() - started, 1),
              "decisions": decisions, "events": events, "verdict": verdict}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "routing-decision.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(decisions, RESULTS / "routing-decision.png")
    print(json.dumps({"decisions": decisions, "events": events, "verdict": verdict}, indent=1))
    return 0


def plot(decisions: list[dict], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(10, 4))
    labels = [f"{d['route'].rsplit('/', 1)[-1]}\n{d['tokens']} tokens\n{d['prompt']}" for d in decisions]
    x = range(len(decisions))
    ax.bar([i - 0.2 for i in x], [d["p50_ms"] for d in decisions], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [d["p99_ms"] for d in decisions], 0.4, label="p99")
    ax.axhline(TARGET_MS, color="red", linestyle="--", label=f"target p99 at 8k ({TARGET_MS} ms)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decision")
    ax.set_title("cache_aware's decision in the router (2 prefills, page size 1)")
    ax.legend()
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
