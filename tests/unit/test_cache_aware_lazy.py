"""cache_aware encodes a text prompt only as far as a prefill holds it: a novel long prompt costs one piece's encode,
its tokens beyond are estimated at the rate of those read, and the routed-prompt credit gets the rest in the event
loop's next turn, so a burst sharing a new long prefix still follows its first request."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Callable
from types import SimpleNamespace

from pdcluster.common.protocol import ModelIdentity, Role
from router.checks.validation import check_generate
from router.fleet.workers import Worker, WorkerPool
from router.kv_routing.cache_aware import CacheAware
from router.kv_routing.kv_routed import RoutedPrompts
from router.kv_routing.kv_wire import Stored
from router.kv_routing.prompt_ids import MAX_CHARS
from router.kv_routing.token_pieces import PIECE_CHARS, PieceTokenizer
from router.metrics import RouterMetrics
from router.pd.policies import make_policy
from router.routing.policy import Choice, RoutingView
from tests.unit.test_cache_aware import choose

IDENTITY = ModelIdentity(model_path="m", served_model_name="m", page_size=1, kv_cache_dtype="auto",
                         transfer_backend="mooncake")
BOS = 1


class Words:
    """A tokenizer of a token a word (which a cut between words keeps: it encodes by pieces), counting what it
    encodes."""

    def __init__(self) -> None:
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        self.chars += len(text)
        ids = [2 + zlib.crc32(word.encode()) % 50_000 for word in text.split()]
        return SimpleNamespace(ids=[BOS, *ids] if add_special_tokens else ids)


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 8))) for _ in range(words))


def setup(held_words: int, shared: str) -> tuple[CacheAware, list[Worker], Words]:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    policy.metrics = RouterMetrics(WorkerPool())
    words = Words()
    policy.tokens.tokenizers["m"] = PieceTokenizer(words)
    assert policy.tokens.tokenizers["m"].by_pieces
    ids = policy.tokens.tokenizers["m"].encode(shared, True)[:held_words + 1]  # its BOS and `held_words` words
    workers = [Worker(f"p{i}", Role.PREFILL, f"http://p{i}", "h", 9000 + i, identity=IDENTITY) for i in range(2)]
    for worker, tokens in zip(workers, (ids, ids[:3]), strict=True):
        policy.index.open(worker.worker_id, 1).apply(
            Stored(tuple(range(1, len(tokens) + 1)), None, tuple(tokens), 1, "GPU"))
    words.chars = 0
    policy.tokens.tokenizers["m"].kept.clear()  # nothing encoded yet
    return policy, workers, words


def request(prompt: str, ids: list[int] | None = None) -> RoutingView:
    """What the policy reads of a /generate of `prompt` (`ids`: its ids by a worker's /tokenize)."""
    body = {"text": prompt}
    return RoutingView("/generate", body, check_generate(body), ids)


def test_a_novel_prompt_costs_one_piece_and_books_its_tokens_at_the_rate_read():
    prompt = text(4000, seed=1)  # ~25k characters, 4001 tokens
    policy, workers, words = setup(2000, text(3000, seed=2))
    novel = request(prompt)
    chosen = asyncio.run(decide(policy, workers, novel, words, lambda read: read < 2 * PIECE_CHARS))
    assert chosen.predicted_cached == 1  # its BOS
    assert chosen.prefill_work is not None and abs(chosen.prefill_work - 4001) < 400  # the estimate: 2x this
    assert novel.checked.prompt_tokens > 2 * 4001


def test_a_shared_prefix_is_matched_to_the_token_and_read_no_further_than_a_piece_past_it():
    shared = text(3000, seed=2)
    policy, workers, words = setup(1003, shared)  # 1004 tokens held: not a whole number of chunks
    tenant = request(shared + " " + text(40, seed=3))
    chosen = asyncio.run(decide(policy, workers, tenant, words, lambda read: read < len(shared) / 2))
    assert chosen.prefill.worker_id == "p0" and chosen.predicted_cached == 1004
    assert chosen.prefill_work is not None and abs(chosen.prefill_work - (3041 - 1004)) < 200  # the rest: estimated


async def decide(policy: CacheAware, workers: list[Worker], routed: RoutingView, words: Words,
                 read_ok: Callable[[int], bool]) -> Choice:
    chosen = choose(policy, workers, routed)
    assert read_ok(words.chars), words.chars
    await asyncio.sleep(0)  # the routed credit's rest
    assert words.chars >= len(routed.body["text"]) - 2 * PIECE_CHARS
    return chosen


def test_a_burst_sharing_a_new_long_prefix_follows_its_first_request_once_its_rest_is_credited():
    policy, workers, _ = setup(2, text(10, seed=4))  # both heard of, neither holds the new prefix
    policy.routed = RoutedPrompts()
    prefix = text(3000, seed=5)

    async def burst() -> list[tuple[str, int | None]]:
        first = choose(policy, workers, request(prefix + " first")).prefill
        first.pending_work_tokens, first.in_flight = 3000, 1
        await asyncio.sleep(0)
        followers = [choose(policy, workers, request(prefix + f" follower {i}")) for i in range(3)]
        return [(first.worker_id, None), *((f.prefill.worker_id, f.predicted_cached) for f in followers)]

    routed = asyncio.run(burst())
    assert {worker for worker, _ in routed} == {routed[0][0]}
    assert all(cached is not None and cached >= 3001 - 16 for _, cached in routed[1:])


def test_ids_a_worker_made_of_a_long_texts_first_characters_book_the_rest_at_their_rate():
    policy, _, _ = setup(2, text(10, seed=6))
    long = request("word " * 20_000, list(range(MAX_CHARS // 5)))  # `ask` tokenizes MAX_CHARS: a token a word
    ids = policy.tokens.lazy(long, "m")
    assert ids is not None and abs(ids.tokens() - 20_000) < 10
    short = request("word " * 100, list(range(100)))
    assert policy.tokens.lazy(short, "m").tokens() == 100  # type: ignore[union-attr]
