"""The prompts a router sent each prefill lately: held there by their leading chunks, until they expire, the oldest
going first past the bound, and none of a worker that left."""

from __future__ import annotations

from router.kv_routing import kv_routed
from router.kv_routing.kv_routed import RoutedPrompts, chunk_keys, chunk_tokens

PROMPT = list(range(1, 101))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_chunks_are_whole_pages_and_keys_chain_everything_before_them():
    assert chunk_tokens(1) == 16 and chunk_tokens(4) == 16 and chunk_tokens(5) == 20 and chunk_tokens(64) == 64
    keys = chunk_keys(PROMPT, 16, 99)
    assert len(keys) == 6  # 96 of the 99 tokens that may be held
    assert chunk_keys([0, *PROMPT[1:]], 16, 99)[1] != keys[1]  # a change in the first chunk changes the second's key
    assert chunk_keys(PROMPT[:40], 16, 39) == keys[:2]


def test_a_routed_prompt_is_held_by_its_leading_chunks_until_it_expires():
    clock = Clock()
    routed = RoutedPrompts(clock=clock)
    routed.add("p0", 16, chunk_keys(PROMPT, 16, 99))
    other = [*PROMPT[:40], *range(500, 560)]  # shares the first 40 tokens: two whole chunks
    assert routed.held(["p0", "p1"], 16, chunk_keys(other, 16, 99)) == {"p0": 32}
    assert routed.held(["p0"], 20, chunk_keys(PROMPT, 20, 99)) == {}  # another page size: other keys
    clock.now = kv_routed.TTL + 1
    assert routed.held(["p0"], 16, chunk_keys(PROMPT, 16, 99)) == {}
    assert routed.keys == {}  # nothing left behind


def test_the_oldest_go_first_past_the_bound_and_a_removed_worker_holds_nothing():
    routed = RoutedPrompts()
    first = chunk_keys(PROMPT, 16, 99)
    routed.add("p0", 16, first)
    for i in range(kv_routed.MAX_PROMPTS):
        routed.add("p1", 16, chunk_keys([i, *PROMPT], 16, 99))
    assert len(routed.prompts) == kv_routed.MAX_PROMPTS
    assert routed.held(["p0"], 16, first) == {}
    assert routed.held(["p1"], 16, chunk_keys([3, *PROMPT], 16, 99)) == {"p1": 96}
    routed.drop("p1")
    assert routed.held(["p1"], 16, chunk_keys([3, *PROMPT], 16, 99)) == {} and not routed.prompts and not routed.keys


def test_a_prompt_credited_in_part_is_extended_unless_forgotten_meanwhile():
    """cache_aware credits what its decision read at once and the rest in the event loop's next turn."""
    clock, keys = Clock(), chunk_keys(PROMPT, 16, 99)
    routed = RoutedPrompts(clock=clock)
    entry = routed.add("p0", 16, keys[:2])
    assert entry is not None and routed.held(["p0"], 16, keys) == {"p0": 32}
    routed.extend(entry, keys)
    assert routed.held(["p0"], 16, keys) == {"p0": 96}
    clock.now = kv_routed.TTL + 1
    assert routed.held(["p0"], 16, keys) == {} and routed.keys == {}  # all its keys expire with it
    gone = routed.add("p1", 16, keys[:1])
    routed.drop("p1")
    assert gone is not None
    routed.extend(gone, keys)  # the worker left before the rest came: nothing is claimed for it
    assert routed.held(["p1"], 16, keys) == {} and not routed.keys


def test_a_walk_beyond_what_a_worker_holds_starts_there():
    routed, keys = RoutedPrompts(), chunk_keys(PROMPT, 16, 99)
    routed.add("p0", 16, keys[:4])
    assert routed.held(["p0"], 16, keys, {"p0": 40}) == {"p0": 64}  # more than its 40: counted
    assert routed.held(["p0"], 16, keys, {"p0": 64}) == {}  # no more than it holds: nothing to add
    assert routed.held(["p0"], 16, [0, 0, *keys[2:]], {"p0": 32}) == {"p0": 64}  # starts at its third chunk


def test_untidy_adds_and_walks_leave_forgetting_to_tidy():
    """cache_aware forgets old prompts after its decision, not in it: each costs a pass over its keys."""
    clock = Clock()
    routed, keys = RoutedPrompts(clock=clock), chunk_keys(PROMPT, 16, 99)
    for i in range(kv_routed.MAX_PROMPTS + 2):
        routed.add("p0", 16, chunk_keys([i, *PROMPT], 16, 99), tidy=False)
    routed.add("p1", 16, keys, tidy=False)
    assert len(routed.prompts) == kv_routed.MAX_PROMPTS + 3
    clock.now = kv_routed.TTL + 1
    assert routed.held(["p1"], 16, keys, expire=False) == {"p1": 96}  # expired, not yet forgotten
    routed.tidy()
    assert not routed.prompts and not routed.keys
