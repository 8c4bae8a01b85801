"""A prompt's ids read only as far as a walk needs them, and the index's chunked keys: the walk hashes a chunk at a
time yet finds where a worker's part ends to the page, in memory and on a store."""

from __future__ import annotations

from collections.abc import Iterator

from router.kv_routing.kv_index import KvIndex
from router.kv_routing.kv_keys import CHUNK, LazyIds
from router.kv_routing.kv_wire import Removed, Stored

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 chunks and 4 tokens at page size 1


def by_pieces(ids: list[int], size: int, pulled: list[int]) -> Iterator[tuple[list[int], int]]:
    """`ids` in pieces of `size`, 2 characters a token; each piece pulled is counted."""
    for start in range(0, len(ids), size):
        pulled.append(start)
        yield ids[start:start + size], 2 * len(ids[start:start + size])


def holding(tokens: int, medium: str = "GPU", worker: str = "a") -> KvIndex:
    kv = KvIndex()
    kv.open(worker, 1).apply(Stored(tuple(range(1, tokens + 1)), None, tuple(PROMPT[:tokens]), 1, medium))
    return kv


def test_the_walk_finds_where_memory_ends_to_the_page_not_the_chunk():
    for tokens in (0, 1, 15, 16, 17, 37, 96, 99, 100):
        assert holding(tokens).match(["a"], PROMPT) == {"a": tokens}, tokens
        assert holding(tokens).match(["a"], PROMPT, limit=99) == {"a": min(tokens, 99)}
    other = [*PROMPT[:37], 0, *PROMPT[38:]]  # differs at token 37: the chunk it is in holds only its first 5
    assert holding(100).match(["a"], other) == {"a": 37}


def test_memory_then_store_is_found_to_the_page_at_page_size_1():
    kv = KvIndex()
    index = kv.open("a", 1, store="s")
    index.apply(Stored(tuple(range(1, 21)), None, tuple(PROMPT[:20]), 1, "GPU"))  # memory: 20 tokens
    index.apply(Stored(tuple(range(21, 51)), 20, tuple(PROMPT[20:50]), 1, "CPU_PINNED"))  # then 30 on the store
    held = kv.held([("a", "s")], PROMPT)["a"]
    assert (held.memory, held.stored) == (50, 0)  # CPU_PINNED is memory too (HiCache's host tier)
    index.apply(Removed(tuple(range(21, 51)), "CPU_PINNED"))
    held = kv.held([("a", "s")], PROMPT)["a"]
    assert (held.memory, held.stored) == (20, 30)


def test_a_lazy_prompt_is_read_no_further_than_a_worker_holds_it():
    pulled: list[int] = []
    ids = LazyIds([], by_pieces(PROMPT, 10, pulled), spare=1, chars=2 * len(PROMPT))
    assert holding(23).match(["a"], ids) == {"a": 23}
    assert pulled == [0, 10, 20, 30]  # to the end of the chunk it misses in (32), and one more token
    assert ids.tokens() == 100  # the rest at the rate read: 2 characters a token
    assert ids.all_chunk_keys(CHUNK) and pulled[-1] == 90 and ids.done and ids.tokens() == 100
    nobody = LazyIds([], by_pieces([7, *PROMPT[1:]], 10, pulled := []), spare=1)
    assert holding(100).match(["a"], nobody) == {"a": 0} and pulled == [0, 10]


def test_a_cut_text_spares_its_last_ids_and_estimates_its_rest():
    ids = LazyIds([], by_pieces(PROMPT, 10, []), spare=1, cut=4, chars=400)  # 200 characters read of 400
    assert holding(100).match(["a"], ids) == {"a": 95}  # 100 read, 4 cut, the last spared
    assert ids.read_all() == PROMPT[:96] and ids.tokens() == 96 + 100
