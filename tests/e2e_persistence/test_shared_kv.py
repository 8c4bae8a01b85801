"""What one worker writes, another reads: prefill replicas share a namespace, and the decode's generated tokens are
on disk for the next turn of a conversation."""

from __future__ import annotations

import httpx

from tests.e2e.reference import assert_matches
from tests.e2e.test_kv_routing import RouterProcess, index_pages
from tests.e2e_persistence.conftest import BOOTSTRAP_PORT, PAGE, TWO_PREFILLS, greedy_ids, prompt_ids
from tests.helpers import CLUSTER_POLL, until

MAX_NEW = 16
CACHE_ROUTER_PORT = 20050


def test_next_turn_finds_the_answer_the_decode_wrote(pc, reference):
    """Turn 1: 600 prompt tokens, 128 generated. The KV of the answer exists only on the decode, which writes each
    page as it completes (the unaligned tail is not written). Turn 2 = turn 1's prompt + answer + 40 new tokens must
    find both in whole pages: at least floor((600 + 128) / 64) * 64 - 64 tokens. The decode may write the last page
    just after its answer returns, so the test waits for the files before turn 2 (without the wait a page may be
    recomputed: slower, never wrong)."""
    pc.ensure()
    tok = reference.tokenizer
    prompt = prompt_ids(tok, "multi-turn", 600)
    pages = pc.pages()
    turn1 = pc.generate(prompt, 128, ignore_eos=True)
    assert turn1.completion_tokens == 128
    written = (600 + 128 - 1) // PAGE  # the last generated token has no KV yet
    assert pc.wait_pages(pages + written) >= pages + written, "the decode did not write the answer's pages"

    turn2 = prompt + turn1.output_ids + prompt_ids(tok, "multi-turn-2", 41)[1:]
    answer = pc.generate(turn2, MAX_NEW)
    assert answer.cached >= (600 + 128) // PAGE * PAGE - PAGE, answer
    assert answer.cached <= written * PAGE, answer
    assert_matches(answer.output_ids, greedy_ids(reference, turn2, MAX_NEW), reference.eos)


def test_a_prompt_cached_by_one_prefill_replica_is_a_storage_hit_on_the_other(pc, reference):
    pc.ensure(TWO_PREFILLS)  # prefill-0 and prefill-1: same config, same namespace
    assert len(pc.namespaces()) == 1, pc.namespaces()
    prompt = prompt_ids(reference.tokenizer, "replicas", 600)
    ref = greedy_ids(reference, prompt, MAX_NEW)
    pages = pc.pages()
    first = pc.generate(prompt, MAX_NEW)
    assert first.cached == 0, first
    pc.wait_pages(pages + 600 // PAGE)
    for _ in range(4):  # round robin: at most a device hit on the first replica before the other's turn
        other = pc.generate(prompt, MAX_NEW)
        if other.prefill != first.prefill:
            break
    assert other.prefill != first.prefill, (first, other)
    assert other.cached >= 512 and other.storage >= 512, other
    assert_matches(first.output_ids, ref, reference.eos)
    assert_matches(other.output_ids, ref, reference.eos)


def test_cache_aware_credits_the_shared_stores_pages_to_a_restarted_prefill(pc, reference, tmp_path):
    """The shared-disk credit: a prompt one prefill computed is on the store both read. That prefill restarted (its
    memory empty, its old index entries dropped), the cache_aware router still predicts the prompt's pages wherever
    it sends the repeat, from the store, and the prefill reads them there: not routed blind, not recomputed."""
    pc.ensure(TWO_PREFILLS)
    router = RouterProcess(tmp_path, f"http://127.0.0.1:{BOOTSTRAP_PORT}", CACHE_ROUTER_PORT)
    try:
        router.start()
        prompt = prompt_ids(reference.tokenizer, "store-credit", 600)
        ref = greedy_ids(reference, prompt, MAX_NEW)
        pages = pc.pages()
        first = cache_generate(router.client, prompt)
        pc.wait_pages(pages + 600 // PAGE)
        name = f"prefill-{int(first['prefill'].rsplit('-', 1)[1]) - pc.port('prefill-0')}"
        held = 512 // PAGE  # pages of the router's index (SGLang's, here of PAGE tokens) of the prompt's first 512
        assert until(lambda: index_pages(router.client).get(first["prefill"], 0) >= held, 30, CLUSTER_POLL), (
            index_pages(router.client))
        pc.restart([name])
        assert until(lambda: _both_usable(router.client), 120, CLUSTER_POLL), router.client.get("/ready").text
        assert until(lambda: index_pages(router.client).get(first["prefill"], 0) < held, 30, CLUSTER_POLL), (
            "the restarted prefill's old entries were kept")
        again = cache_generate(router.client, prompt)
        assert (again["predicted"] or 0) >= 512, again  # the store's pages, credited to either prefill
        assert again["cached"] >= 512 and again["storage"] >= 512, again
        assert_matches(first["output_ids"], ref, reference.eos)
        assert_matches(again["output_ids"], ref, reference.eos)
        assert 'pdcluster_router_routing_decisions_total{kind="blind"}' not in router.client.get("/metrics").text
    finally:
        router.client.close()
        router.stop()


def cache_generate(client: httpx.Client, ids: list[int]) -> dict:
    response = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW,
                                                                                     "temperature": 0}})
    assert response.status_code == 200, response.text
    meta, predicted = response.json()["meta_info"], response.headers.get("x-pdcluster-cached-tokens-predicted")
    return {"prefill": response.headers["x-pdcluster-prefill"], "output_ids": response.json()["output_ids"],
            "cached": meta.get("cached_tokens", 0),
            "storage": int((meta.get("cached_tokens_details") or {}).get("storage") or 0),
            "predicted": int(predicted) if predicted is not None else None}


def _both_usable(client: httpx.Client) -> bool:
    try:
        workers = client.get("/ready", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return sum(w["role"] == "prefill" and not w["unusable"] for w in workers) == 2
