"""The router's subscription to a prefill's KV events, against a fake SGLang publisher on loopback: live batches
indexed, gaps replayed or the index dropped, a sequence going back, a new instance (its KV store's pages kept), and a
hostile publisher."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import zmq.asyncio

from pdcluster.common.protocol import KVEventsEndpoint, KVStoreMembership, ModelIdentity, Role
from router.fleet.workers import Worker, WorkerPool
from router.kv_routing.kv_events import Subscription, follow_kv_events
from router.kv_routing.kv_index import KvIndex
from router.kv_routing.kv_wire import Stored
from router.metrics import RouterMetrics
from tests.unit.kv_event_fakes import PAGE, FakePublisher, frames, stored

TOKENS = list(range(100, 116))
IDENTITY = ModelIdentity(model_path="m", served_model_name="m", page_size=PAGE, kv_cache_dtype="auto",
                         transfer_backend="mooncake")


def prefill(publisher: FakePublisher | None, instance: str = "i1", replay: bool = True, port: int = 1) -> Worker:
    endpoint = KVEventsEndpoint(host="127.0.0.1", port=publisher.port if publisher else port,
                                replay_port=publisher.replay_port if publisher and replay else None)
    return Worker("p0", Role.PREFILL, "http://p0", "h", 9000, identity=IDENTITY, instance_id=instance,
                  kv_events=endpoint)


def metric(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out: {check.__code__.co_consts}"
        await asyncio.sleep(0.02)


def subscription(replay_port: int | None = None) -> tuple[Subscription, KvIndex, RouterMetrics]:
    index, metrics = KvIndex(), RouterMetrics(WorkerPool())
    worker = prefill(None)
    endpoint = KVEventsEndpoint(host="127.0.0.1", port=1, replay_port=replay_port)
    sub = Subscription(None, worker, endpoint, index, metrics)  # type: ignore[arg-type] - receive() needs no socket
    index.open("p0", PAGE)
    return sub, index, metrics


def test_a_gap_without_a_replay_socket_drops_the_index_and_indexes_afresh():
    sub, index, metrics = subscription()
    assert sub.receive(frames(0, [stored([1, 2], TOKENS[:8])])) is None
    assert index.match(["p0"], TOKENS) == {"p0": 8}
    assert sub.receive(frames(5, [stored([9], TOKENS[8:12], parent=2)])) is None  # 1-4 lost
    assert metric(metrics, "pdcluster_router_kv_event_gaps_total", worker="p0") == 1
    assert metric(metrics, "pdcluster_router_kv_index_resyncs_total", worker="p0", reason="gap") == 1
    assert index.match(["p0"], TOKENS) == {"p0": 0}  # what it held is no longer trusted: a removal may be lost
    assert sub.expected == 6


def test_a_gap_with_a_replay_socket_asks_for_a_replay_and_a_sequence_going_back_drops_the_index():
    sub, index, metrics = subscription(replay_port=2)
    sub.receive(frames(0, [stored([1], TOKENS[:4])]))
    assert sub.receive(frames(3, [])) == 1  # the subscription replays from 1 (its run loop does)
    sub.receive(frames(1, [stored([2], TOKENS[4:8], parent=1)]))
    assert index.match(["p0"], TOKENS) == {"p0": 8}
    sub.receive(frames(0, [stored([5], TOKENS[:4])]))  # the publisher restarted: its sequence starts over
    assert metric(metrics, "pdcluster_router_kv_index_resyncs_total", worker="p0", reason="sequence_back") == 1
    assert index.match(["p0"], TOKENS) == {"p0": 4} and len(index.workers["p0"].pages) == 1


def test_a_live_batchs_lag_is_measured_from_its_publication():
    sub, _, metrics = subscription()
    sub.receive(frames(0, [stored([1], TOKENS[:4])], ts=time.time() - 0.3))
    sub.receive(frames(1, [], ts=time.time() + 60))  # a publisher whose clock runs ahead: no lag, never a negative one

    def lag(sample: str, **labels: str) -> float:
        return metric(metrics, f"pdcluster_router_kv_event_lag_seconds_{sample}", worker="p0", **labels)

    assert lag("count") == 2 and 0.3 <= lag("sum") < 5
    assert lag("bucket", le="0.25") == 1 and lag("bucket", le="1.0") == 2


def test_live_events_from_a_publisher_reach_the_index_and_a_lost_batch_is_replayed():
    publisher, metrics = FakePublisher(), RouterMetrics(WorkerPool())

    async def scenario() -> None:
        index = KvIndex()
        sub = Subscription(zmq.asyncio.Context(), prefill(publisher), prefill(publisher).kv_events, index, metrics)
        task = asyncio.create_task(sub.run())
        await eventually(lambda: publisher.replays == [0])  # a new subscription first asks for what is buffered
        sequence = 0
        while sub.expected is None:  # ZMQ's slow joiner: empty batches until the subscription hears one
            publisher.publish(sequence, [])
            sequence += 1
            await asyncio.sleep(0.02)
        publisher.publish(sequence, [stored([1], TOKENS[:4])])
        publisher.publish(sequence + 1, [stored([2], TOKENS[4:8], parent=1)], live=False)  # lost on the way
        publisher.publish(sequence + 2, [stored([3], TOKENS[8:12], parent=2)])
        await eventually(lambda: index.match(["p0"], TOKENS) == {"p0": 12})
        assert publisher.replays == [0, sequence + 1]
        assert metric(metrics, "pdcluster_router_kv_index_resyncs_total", worker="p0", reason="replayed") == 1
        task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()


def test_a_hostile_publisher_is_bounded_and_never_ends_the_subscription():
    publisher, metrics = FakePublisher(), RouterMetrics(WorkerPool())

    async def scenario() -> None:
        index = KvIndex(max_pages=50)
        sub = Subscription(zmq.asyncio.Context(), prefill(publisher), prefill(publisher).kv_events, index, metrics)
        sub.idle = 0.5
        task = asyncio.create_task(sub.run())
        await eventually(lambda: publisher.replays == [0])
        for _ in range(3000):  # ~60 s at most, even on a loaded machine; never a hang
            if sub.expected is not None:
                break
            assert not task.done(), task  # a subscription that ended would leave this loop waiting forever
            publisher.publish(0, [])
            await asyncio.sleep(0.02)
            if sub.expected is None:
                publisher.buffer.clear()
        assert sub.expected is not None, "the subscription never applied a batch"
        publisher.send_raw([b"", b"\x00" * 8, b"\xc1" * 100])  # garbage
        publisher.send_raw([b"", b"\x00" * 8, b"\x00" * (20 * 2**20)])  # over ZMQ's MAXMSGSIZE: never buffered
        for i in range(1, 2001):  # a flood of new roots: the index stays within its bound
            publisher.publish(i, [stored([10_000 + i], [i] * PAGE)])
        sequence, deadline = 2001, time.monotonic() + 90  # generous: the replay of 2000 batches on a busy machine
        # The huge frame cost the connection (ZMQ drops a peer that sends one, for good) and the flood went meanwhile:
        # after a silence the subscription subscribes anew, and the next batch shows the gap, which the replay closes.
        while metric(metrics, "pdcluster_router_kv_event_batches_total", worker="p0", result="applied") < 2000:
            publisher.publish(sequence, [])
            sequence += 1
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, "the subscription never caught up"
        assert len(index.workers["p0"].pages) <= 50
        assert metric(metrics, "pdcluster_router_kv_event_batches_total", worker="p0", result="malformed") >= 1
        assert not task.done()
        task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()


def test_a_new_instance_drops_the_workers_entries_and_subscribes_again():
    async def scenario() -> None:
        pool, index, metrics = WorkerPool(admission_check=False), KvIndex(), RouterMetrics(WorkerPool())
        worker = pool.workers["p0"] = prefill(None, "i1", replay=False, port=1)
        task = asyncio.create_task(follow_kv_events(pool, index, metrics))
        await eventually(lambda: index.live("p0"))
        index.workers["p0"].keys[1] = 1  # it held something
        pool.workers["p0"] = prefill(None, "i2", replay=False, port=1)  # restarted at the same address
        await eventually(lambda: metric(metrics, "pdcluster_router_kv_index_resyncs_total", worker="p0",
                                        reason="new_instance") == 1)
        # the resync is counted in the pass that starts the new subscription; it opens the index when it first runs
        await eventually(lambda: index.live("p0"))
        assert not index.workers["p0"].keys
        del pool.workers["p0"]
        await eventually(lambda: not index.live("p0"))
        assert worker.instance_id == "i1"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_a_new_instance_is_not_credited_with_what_its_predecessor_was_sent():
    """cache_aware counts a prompt it routed as held until the prefill's events tell (router/kv_routing/kv_routed.py); a
    restarted prefill's memory is empty, so that credit goes with its old subscription."""
    async def scenario() -> None:
        from router.kv_routing import kv_events
        from router.kv_routing.cache_aware import CacheAware
        from router.pd.policies import make_policy

        policy, pool = make_policy("cache_aware"), WorkerPool(admission_check=False)
        assert isinstance(policy, CacheAware)
        pool.workers["p0"] = prefill(None, "i1", replay=False, port=1)
        tasks = kv_events.start(policy, pool, RouterMetrics(WorkerPool()), client=None)  # type: ignore[arg-type]
        await eventually(lambda: policy.index.live("p0"))
        policy.routed.add("p0", 16, [11, 12])
        pool.workers["p0"] = prefill(None, "i2", replay=False, port=1)  # restarted at the same address
        await eventually(lambda: not policy.routed.prompts)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_new_instance_keeps_its_kv_stores_pages_and_joins_the_store_again():
    store = KVStoreMembership(namespace="0123456789abcdef", store_id="c" * 32)

    async def scenario() -> None:
        pool, index = WorkerPool(admission_check=False), KvIndex()
        pool.workers["p0"] = replace(prefill(None, "i1", replay=False), kv_store=store)
        task = asyncio.create_task(follow_kv_events(pool, index, None))
        await eventually(lambda: index.live("p0"))
        index.apply("p0", [Stored((1,), None, tuple(TOKENS[:4]), PAGE, "CPU_PINNED")])  # host memory: on the store
        pool.workers["p0"] = replace(prefill(None, "i2", replay=False), kv_store=store)  # restarted
        await eventually(lambda: index.live("p0") and not index.workers["p0"].keys)
        assert index.stores[store.store].members == {"p0"}  # type: ignore[index]
        assert index.held([("p0", store.store)], TOKENS)["p0"].stored == 4
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
