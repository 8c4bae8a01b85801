"""cache_aware with KV stores on disk: a page on a store counts for every prefill registered with that store (same
namespace and directory), after what it holds in memory and at a quarter of a computed token's cost; a restarted
prefill keeps its store's credit; the same namespace on another disk is another store."""

from __future__ import annotations

from pdcluster.common.protocol import KVStoreMembership, Role, WorkerRegistration
from router.fleet.workers import Worker
from router.kv_routing.cache_aware import CacheAware
from router.kv_routing.kv_index import KvIndex
from router.kv_routing.kv_routed import RoutedPrompts
from router.kv_routing.kv_wire import Removed, Stored
from router.pd.policies import make_policy
from tests.unit.test_bootstrap_kv_secret import NS, kv_worker
from tests.unit.test_cache_aware import IDENTITY, PAGE, PROMPT, choose, request

SHARED = KVStoreMembership(namespace=NS, store_id="a" * 32)  # one volume, mounted by several prefills
ELSEWHERE = KVStoreMembership(namespace=NS, store_id="b" * 32)  # the same model and format on another host's disk


def prefill(worker_id: str, store: KVStoreMembership | None) -> Worker:
    return Worker(worker_id, Role.PREFILL, f"http://{worker_id}", "h", 9000, identity=IDENTITY, kv_store=store)


def policy() -> CacheAware:
    made = make_policy("cache_aware")
    assert isinstance(made, CacheAware)
    made.routed = RoutedPrompts(ttl=0)  # the index alone: what was routed is forgotten at once
    return made


def hold(index: KvIndex, worker: Worker, tokens: int, medium: str = "CPU_PINNED") -> None:
    """The worker subscribed, holding `tokens` leading tokens of PROMPT in `medium` (host memory: written through to
    its store, if it has one)."""
    if worker.worker_id not in index.workers:
        index.open(worker.worker_id, PAGE, worker.kv_store.store if worker.kv_store else None)
    pages = tokens // PAGE
    index.apply(worker.worker_id, [Stored(tuple(range(1, pages + 1)), None, tuple(PROMPT[:tokens]), PAGE, medium)])


def test_the_registration_names_the_store_and_the_router_keeps_it():
    registration = WorkerRegistration.model_validate(kv_worker("p1", None) | {"kv_store": SHARED.model_dump()})
    worker = Worker.from_registration(registration)
    assert worker.kv_store == SHARED and worker.kv_store.store == f"{NS}/{'a' * 32}"
    assert KVStoreMembership(namespace=NS).store is None, "no directory id (an older launcher): no shared credit"
    moved = Worker.from_registration(registration.model_copy(update={"kv_store": ELSEWHERE}))
    assert moved.registered_as() != worker.registered_as(), "another store: another worker for the pool"


def test_a_replica_reads_what_the_other_wrote_and_memory_wins_until_its_queue_costs_more():
    chooser = policy()
    p0, p1, p2 = prefill("p0", SHARED), prefill("p1", SHARED), prefill("p2", None)
    hold(chooser.index, p0, 320, "GPU")
    hold(chooser.index, p0, 320)  # and in its host memory: so on the shared store
    hold(chooser.index, p1, 0)
    hold(chooser.index, p2, 320)  # host memory without a store: its own, no one else's
    assert choose(chooser, [p1, p2], request(PROMPT)).prefill.worker_id == "p2", "p2's memory beats p1's reading"
    routed = choose(chooser, [p0, p1], request(PROMPT))
    assert routed.prefill.worker_id == "p0" and routed.predicted_cached == 320
    # p1 would read what p0 holds in memory: a quarter of 320 computed tokens, and as much again for the copy.
    p0.pending_work_tokens = 150  # a queue shorter than those 160: still p0
    assert choose(chooser, [p0, p1], request(PROMPT)).prefill.worker_id == "p0"
    p0.pending_work_tokens = 200  # longer: reading them on p1 is cheaper
    routed = choose(chooser, [p0, p1], request(PROMPT))
    assert routed.prefill.worker_id == "p1"
    assert routed.predicted_cached == 320, "what the answer's cached_tokens will count (storage included)"
    p1.pending_work_tokens = 10_000
    assert choose(chooser, [p1, prefill("p3", None)], request(PROMPT)).prefill.worker_id == "p3", "load still counts"


def test_a_restarted_prefill_keeps_its_stores_credit_and_gets_its_prefix_back():
    chooser = policy()
    p0, cold = prefill("p0", SHARED), prefill("cold", ELSEWHERE)  # same namespace, another disk
    hold(chooser.index, p0, 400)
    hold(chooser.index, cold, 0)
    chooser.index.apply("p0", [Removed(tuple(range(1, 101)), "CPU_PINNED")])  # evicted from memory: still on disk
    assert choose(chooser, [p0, cold], request(PROMPT)).prefill.worker_id == "p0"
    chooser.index.drop("p0")  # restarted: a new incarnation's memory is empty, and not yet subscribed or heard
    routed = choose(chooser, [p0, cold], request(PROMPT))
    assert routed.prefill.worker_id == "p0", "its warm disk draws its prefix back"
    assert routed.predicted_cached == 396
    assert chooser.index.held([("cold", ELSEWHERE.store)], PROMPT)["cold"].tokens == 0
    chooser.index.open("p0", PAGE, SHARED.store)  # subscribed again: the store's pages still count
    assert choose(chooser, [p0, cold], request(PROMPT)).prefill.worker_id == "p0"


def test_known_by_its_store_alone_a_prefill_is_not_routed_blind():
    chooser = policy()
    p0, p1 = prefill("p0", SHARED), prefill("p1", SHARED)
    hold(chooser.index, p0, 400)
    chooser.index.drop("p0")  # both restarting, say: no events heard from either
    assert not chooser.index.heard("p0") and not chooser.index.heard("p1")
    p1.pending_work_tokens = 50
    assert {choose(chooser, [p0, p1], request(PROMPT)).prefill.worker_id for _ in range(5)} == {"p0"}, "not round robin"
