"""SGLang's KV event wire, both forms, read defensively; the index it feeds: stored, removed, cleared, tiers, bounds,
and the KV stores that several workers share."""

from __future__ import annotations

import msgspec
import pytest

from router.kv_routing.kv_index import KvIndex, WorkerIndex
from router.kv_routing.kv_wire import Cleared, Malformed, Removed, Stored, decode
from tests.unit.kv_event_fakes import PAGE, cleared, frames, positional_payload, removed, stored

PROMPT = list(range(100, 116))  # 4 pages of PAGE tokens


def chain(first_hash: int, tokens: list[int]) -> list[int]:
    return [first_hash + i for i in range(len(tokens) // PAGE)]


@pytest.mark.parametrize("form", ["tagged", "positional"])
def test_both_wire_forms_decode_to_the_same_events(form):
    events = [stored([1, 2], PROMPT[:8]), stored([3], PROMPT[8:12], parent=2, medium="CPU_PINNED"),
              removed([3], "CPU_PINNED"), cleared()]
    parts = frames(7, events)
    if form == "positional":
        parts[2] = positional_payload(events)
    batch = decode(parts)
    assert batch.sequence == 7 and batch.skipped == 0 and batch.published == 1.0
    assert batch.events == (Stored((1, 2), None, tuple(PROMPT[:8]), PAGE, "GPU"),
                            Stored((3,), 2, tuple(PROMPT[8:12]), PAGE, "CPU_PINNED"),
                            Removed((3,), "CPU_PINNED"), Cleared())


@pytest.mark.parametrize("parts", [
    [b"", b"\x00" * 8],  # two frames
    [b"", b"\x00" * 7, b"\x90"],  # a short sequence
    [b"", b"\x00" * 8, b"\xc1garbage"],  # not msgpack
    [b"", b"\x00" * 8, msgspec.msgpack.encode({"a": 1})],  # not a batch
    [b"", b"\x00" * 8, b"\x91" * 200_000 + b"\x01"],  # nested past any stack
    [b"", b"\x00" * 8, b"\xc6" + (17 * 2**20).to_bytes(4, "big") + b"\x00" * (17 * 2**20)],  # a huge frame
])
def test_garbage_is_malformed_never_a_crash(parts):
    with pytest.raises(Malformed):
        decode(parts)


def test_nonsense_events_are_skipped_and_the_rest_kept():
    raw = [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                  "block_size": PAGE},  # 2 tokens for a page of 4... is a partial page: kept
                 {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1], "block_size": PAGE},  # 2 pages?
                 {"type": "BlockStored", "block_hashes": [True], "token_ids": [1], "block_size": 1},  # a bool hash
                 {"type": "BlockRemoved", "block_hashes": [5], "medium": "TAPE"},  # no such tier
                 ["Unknown", 1], 42, {"type": "BlockRemoved", "block_hashes": [5]}], 0]
    batch = decode([b"", b"\x00" * 8, msgspec.msgpack.encode(raw)])
    assert batch.skipped == 5 and len(batch.events) == 2 and batch.events[1] == Removed((5,), "GPU")


def stored_prompt(index: WorkerIndex, tokens: list[int], first_hash: int = 1, medium: str = "GPU") -> None:
    index.apply(Stored(tuple(chain(first_hash, tokens)), None, tuple(tokens), PAGE, medium))


def test_stored_pages_match_by_content_whole_pages_only():
    kv = KvIndex()
    stored_prompt(kv.open("a", PAGE), PROMPT[:12])
    kv.open("b", PAGE)
    assert kv.match(["a", "b"], PROMPT) == {"a": 12, "b": 0}
    assert kv.match(["a"], PROMPT[:10]) == {"a": 8}  # the third page is not whole in the request
    assert kv.match(["a"], [0, *PROMPT]) == {"a": 0}  # the same tokens one position later: another prefix
    other = [*PROMPT[:4], 0, *PROMPT[5:]]
    assert kv.match(["a"], other) == {"a": 4}  # a page's key chains everything before it
    assert kv.match(["nobody"], PROMPT) == {}
    # What SGLang reuses of a 12-token prompt it holds whole: the pages of its first 11 tokens (it computes one).
    assert kv.match(["a"], PROMPT[:12], limit=11) == {"a": 8}


def test_a_child_stored_later_chains_from_its_parent_and_an_orphan_is_not_indexed():
    index = KvIndex().open("a", PAGE)
    stored_prompt(index, PROMPT[:4])
    index.apply(Stored((2,), 1, tuple(PROMPT[4:8]), PAGE, "GPU"))
    index.apply(Stored((99,), 77, tuple(PROMPT[8:12]), PAGE, "GPU"))  # its parent was never seen
    assert len(index.pages) == 2 and index.orphans == 1


def test_removed_per_tier_and_cleared():
    kv = KvIndex()
    index = kv.open("a", PAGE)
    stored_prompt(index, PROMPT)
    stored_prompt(index, PROMPT[:8], medium="CPU_PINNED")  # HiCache's host copy of the first two pages
    index.apply(Removed((1, 2, 3, 4), "GPU"))  # evicted from the device: the host copies still count
    assert kv.match(["a"], PROMPT) == {"a": 8}
    index.apply(Removed((1,), "CPU_PINNED"))
    assert kv.match(["a"], PROMPT) == {"a": 0} and len(index.pages) == 1
    index.apply(Cleared())
    assert not index.pages and not index.keys


def test_the_index_is_bounded_per_worker():
    kv = KvIndex(max_pages=3)
    index = kv.open("a", PAGE)
    stored_prompt(index, PROMPT)
    assert len(index.pages) == 3 and index.overflow == 1 and kv.match(["a"], PROMPT) == {"a": 12}


def test_a_partial_page_is_not_indexed_and_does_not_change_the_page_size():
    kv = KvIndex()
    index = kv.open("a", PAGE)
    index.apply(Stored((1,), None, tuple(PROMPT[:3]), 3, "GPU"))
    assert not index.pages and index.block_size == PAGE


STORE = "0123456789abcdef/" + "5" * 32  # a KVStoreMembership.store: namespace and directory id


def test_a_page_written_through_to_a_shared_store_counts_for_every_worker_of_that_store_after_its_memory():
    kv = KvIndex()
    a, b = kv.open("a", PAGE, STORE), kv.open("b", PAGE, STORE)
    stored_prompt(a, PROMPT)  # on a's device: not yet on the store (HiCache writes it through from host memory)
    assert kv.held([("b", STORE)], PROMPT)["b"].tokens == 0 and not kv.known("b", STORE)
    stored_prompt(a, PROMPT[:12], medium="CPU_PINNED")  # in a's host memory: on its way to the store
    held = kv.held([("a", STORE), ("b", STORE)], PROMPT)
    assert (held["a"].memory, held["a"].stored) == (16, 0), "a reads its memory first"
    assert (held["b"].memory, held["b"].stored) == (0, 12) and held["b"].tokens == 12
    stored_prompt(b, PROMPT[:4])  # b holds the first page itself: then reads the next two from the store
    held = kv.held([("b", STORE)], PROMPT)["b"]
    assert (held.memory, held.stored) == (4, 8)
    assert kv.match(["b"], PROMPT) == {"b": 4}, "match: memory only"
    a.apply(Removed(tuple(chain(1, PROMPT)), "GPU"))
    a.apply(Removed(tuple(chain(1, PROMPT[:12])), "CPU_PINNED"))  # evicted from a's memory: still on the disk
    a.apply(Cleared())  # a's flush clears its memory, never the store
    held = kv.held([("a", STORE)], PROMPT)["a"]
    assert (held.memory, held.stored) == (0, 12) and kv.known("a", STORE)


def test_a_restarted_worker_loses_its_memory_and_keeps_its_stores_pages():
    kv = KvIndex()
    stored_prompt(kv.open("a", PAGE, STORE), PROMPT, medium="CPU_PINNED")
    kv.drop("a")  # a new instance registered: its old entries go ...
    assert not kv.heard("a") and kv.known("a", STORE), "... but not its store's"
    held = kv.held([("a", STORE)], PROMPT)["a"]  # not subscribed again yet: its store's pages, at the store's rate
    assert (held.memory, held.stored) == (0, 16)
    kv.open("a", PAGE, STORE)
    assert kv.held([("a", STORE)], PROMPT)["a"].stored == 16 and kv.match(["a"], PROMPT) == {"a": 0}


def test_the_same_namespace_on_another_disk_is_another_store_and_a_worker_without_one_gets_no_credit():
    kv = KvIndex()
    other = "0123456789abcdef/" + "6" * 32  # same model and format, another host's directory
    stored_prompt(kv.open("a", PAGE, STORE), PROMPT, medium="CPU_PINNED")
    kv.open("b", PAGE, other)
    kv.open("c", PAGE)  # registered no store (none, or an older launcher): HiCache's host pages are its memory only
    held = kv.held([("a", STORE), ("b", other), ("c", None)], PROMPT)
    assert held["a"].tokens == 16 and held["b"].tokens == 0 and held["c"].tokens == 0
    assert not kv.known("b", other) and not kv.known("c", None)


def test_storage_media_feed_the_store_and_a_store_is_bounded_least_recent_first():
    kv = KvIndex(max_pages=3)
    a = kv.open("a", PAGE, STORE)
    stored_prompt(a, PROMPT[:8], medium="DISK")  # not sent by SGLang 0.5.23; read should a later one send it
    assert not a.pages and kv.held([("a", STORE)], PROMPT)["a"].stored == 8
    a.apply(Stored((3,), 2, tuple(PROMPT[8:12]), PAGE, "GPU"))  # its parent only on the store: still chained
    assert kv.held([("a", STORE)], PROMPT)["a"].stored == 8 and a.orphans == 0 and len(a.pages) == 1
    a.apply(Removed((2,), "DISK"))
    assert kv.held([("a", STORE)], PROMPT)["a"].stored == 4
    stored_prompt(a, PROMPT, medium="EXTERNAL")  # 4 pages into a store of 3: the least recent goes
    assert list(kv.stores[STORE].pages) == [2, 3, 4] and kv.held([("a", STORE)], PROMPT)["a"].stored == 0


def test_stores_without_workers_are_kept_a_few_the_longest_idle_going_first():
    kv = KvIndex()
    names = [f"0123456789abcdef/{i:032x}" for i in range(8)]
    for i, name in enumerate(names[:6]):
        kv.open(f"w{i}", PAGE, name)
        kv.drop(f"w{i}")
    assert list(kv.stores) == names[2:6], "the 4 most recently idle kept"
    kv.open("w2", PAGE, names[2])  # a restarted worker of an idle store: in use again
    for i in (6, 7):
        kv.open(f"w{i}", PAGE, names[i])
        kv.drop(f"w{i}")
    assert list(kv.stores) == [names[2], *names[4:8]], "the longest idle one went; the one in use stays"


def test_at_page_size_one_a_prompt_matches_token_by_token():
    """SGLang on CPU (and many GPU backends) publishes pages of one token: the walk's fast path keys them as the
    events' pages are keyed."""
    kv = KvIndex()
    kv.open("a", 1).apply(Stored(tuple(range(1, 13)), None, tuple(PROMPT[:12]), 1, "GPU"))
    assert kv.match(["a"], PROMPT) == {"a": 12}
    assert kv.match(["a"], [*PROMPT[:7], 0, *PROMPT[8:]]) == {"a": 7}
    assert kv.match(["a"], PROMPT, limit=5) == {"a": 5}
