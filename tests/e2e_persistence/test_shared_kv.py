"""What one worker writes, another reads: prefill replicas share a namespace, and the decode's generated tokens are
on disk for the next turn of a conversation."""

from __future__ import annotations

from tests.e2e.reference import assert_matches
from tests.e2e_persistence.conftest import PAGE, TWO_PREFILLS, greedy_ids, prompt_ids

MAX_NEW = 16


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
