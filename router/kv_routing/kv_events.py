"""The router's subscriptions to its prefills' KV events (SGLang's ZMQ PUB; the wire: router/kv_routing/kv_wire.py),
kept in the cache_aware policy's index (router/kv_routing/kv_index.py).

One subscription per registered worker instance. A new instance (its launcher's instance_id: a restart, even at the
same address), endpoint or KV store ends the old subscription and its entries: a restarted prefill's cache is not its
predecessor's (its KV store's pages, indexed apart, stay: router/kv_routing/kv_index.py). A subscription first asks the
publisher's replay socket for every batch it still buffers, so a router that (re)starts knows what the prefill held
before it came. Then, batch by batch, in sequence:
- a gap (a batch lost: ZMQ drops past its high-water mark) is replayed from the replay socket; without one, or if
  the replay cannot close it, the worker's entries are dropped and it is indexed afresh from there on;
- a sequence that goes back (the publisher restarted) drops its entries too.
Each live batch's lag (SGLang stamps a batch with its wall clock) is measured, to tell a slow index from a wrong one.
A hostile or broken publisher is bounded: ZMQ refuses frames over MAX_FRAME_BYTES, the socket queues at most RCVHWM
messages, the index holds at most its max_pages per worker, malformed batches are counted and logged once, and a
flood yields the event loop every few messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from pdcluster.common.protocol import KVEventsEndpoint, Role
from router.fleet.workers import Worker, WorkerPool
from router.kv_routing.cache_aware import CacheAware
from router.kv_routing.kv_index import KvIndex
from router.kv_routing.kv_wire import END_OF_REPLAY, MAX_FRAME_BYTES, Batch, Malformed, decode, sequence_of
from router.metrics import RouterMetrics
from router.routing.policy import Policy
from router.transport.upstream import UpstreamClient

log = logging.getLogger("pdcluster.router")

RCVHWM = 1_000  # messages queued per subscription (each at most MAX_FRAME_BYTES)
REPLAY_TIMEOUT = 2.0  # seconds for each message of a replay
MAX_REPLAY = 20_000  # batches in one replay (SGLang buffers 10,000)
YIELD_EVERY = 64  # messages handled between two yields to the event loop
FOLLOW_INTERVAL = 0.5  # seconds between two looks at the pool
IDLE_RESUBSCRIBE = 30.0  # seconds without a message before the SUB socket is made anew


def tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


class Subscription:
    """One worker instance's event stream into the index."""

    def __init__(self, context: zmq.asyncio.Context, worker: Worker, endpoint: KVEventsEndpoint, index: KvIndex,
                 metrics: RouterMetrics | None):
        self.context, self.worker, self.endpoint, self.index, self.metrics = context, worker, endpoint, index, metrics
        self.worker_id = worker.worker_id
        self.page_size = worker.identity.page_size if worker.identity else None
        self.store = worker.kv_store.store if worker.kv_store else None
        self.expected: int | None = None  # the next sequence
        self.replayed = False  # live batches below `expected` are then the replay's duplicates
        self.warned = False
        self.idle = IDLE_RESUBSCRIBE

    async def run(self) -> None:
        self.index.open(self.worker_id, self.page_size, self.store)
        socket = self._subscribe()
        try:
            await self._replay(0, "start")
            handled = 0
            while True:
                try:
                    message = await asyncio.wait_for(socket.recv_multipart(), self.idle)
                except TimeoutError:
                    # Silence: an idle prefill, or a connection ZMQ dropped and will not make again (it does not
                    # after a frame over MAXMSGSIZE). A fresh socket costs nothing; what it missed shows as a gap.
                    socket.close(linger=0)
                    socket = self._subscribe()
                    continue
                replay_from = self.receive(message)
                if replay_from is not None:
                    await self._replay(replay_from, "gap")
                handled += 1
                if handled % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # a flood of ready messages would otherwise never yield
        finally:
            socket.close(linger=0)

    def _subscribe(self) -> zmq.asyncio.Socket:
        socket = self._socket(zmq.SUB, self.endpoint.port)
        socket.setsockopt(zmq.RCVHWM, RCVHWM)
        socket.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        return socket

    def receive(self, frames: list[bytes]) -> int | None:
        """One live message. Returns the sequence to replay from when it shows a gap the replay socket may close
        (the batch itself is then replayed with what was missed)."""
        try:
            batch = decode(frames)
        except Malformed as exc:
            self._count("malformed")
            self._warn(f"unreadable KV event message ({exc})")
            return None
        sequence = batch.sequence
        if self.expected is not None and sequence < self.expected:
            if self.replayed:
                self._count("duplicate")
                return None
            self._resync("sequence_back")  # the publisher restarted: what it said before is void
        elif self.expected is not None and sequence > self.expected:
            if self.metrics:
                self.metrics.kv_gaps.labels(self.worker_id).inc()
            if self.endpoint.replay_port is not None:
                return self.expected
            self._resync("gap")
        self.replayed = False
        self._apply(batch)
        if self.metrics and batch.published is not None:  # a replayed batch is old by design: live ones only
            self.metrics.kv_lag.labels(self.worker_id).observe(max(0.0, time.time() - batch.published))
        return None

    def _apply(self, batch: Batch) -> None:
        self.index.apply(self.worker_id, batch.events)
        self.expected = batch.sequence + 1
        self._count("applied")
        if batch.skipped:
            self._count("malformed")
            self._warn(f"{batch.skipped} unreadable KV events in a batch")

    def _resync(self, reason: str) -> None:
        """Forget what the worker holds; index it afresh from the next batch."""
        self.index.open(self.worker_id, self.page_size, self.store)
        self.expected = None
        if self.metrics:
            self.metrics.kv_resyncs.labels(self.worker_id, reason).inc()

    async def _replay(self, start: int, why: str) -> None:
        """What the publisher still buffers from `start` on, into the index. Without a replay socket, or when it
        does not answer, the index goes on from the next live batch."""
        if self.endpoint.replay_port is None:
            return
        dealer = self._socket(zmq.DEALER, self.endpoint.replay_port)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(MAX_REPLAY):
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT)
                if len(frames) != 4:
                    raise Malformed(f"a replay message of {len(frames)} frames")
                if sequence_of(frames[2]) == END_OF_REPLAY:
                    break
                batch = decode(frames[1:])
                if self.expected is not None and batch.sequence < self.expected:
                    continue
                if self.expected is not None and batch.sequence > self.expected:
                    self._resync("replay_incomplete")  # the buffer no longer has what was missed
                self._apply(batch)
            self.replayed = True
            if self.metrics and why != "start":
                self.metrics.kv_resyncs.labels(self.worker_id, "replayed").inc()
        except (TimeoutError, Malformed, zmq.ZMQError) as exc:
            if why != "start":  # at start a publisher may not be up yet: its live batches index it
                self._resync("replay_failed")
                self._warn(f"KV event replay from {start} failed ({type(exc).__name__}: {exc})")
        finally:
            dealer.close(linger=0)

    def _socket(self, kind: int, port: int) -> zmq.asyncio.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)  # a larger message drops the peer's connection
        socket.connect(tcp(self.endpoint.host, port))
        return socket

    def _count(self, result: str) -> None:
        if self.metrics:
            self.metrics.kv_batches.labels(self.worker_id, result).inc()

    def _warn(self, message: str) -> None:
        if not self.warned:  # once per subscription: a publisher sending garbage must not flood the log
            self.warned = True
            log.warning(message, extra={"worker": self.worker_id})


def _subscribed_as(worker: Worker) -> tuple:
    return worker.instance_id, worker.kv_events, worker.kv_store


async def follow_kv_events(pool: WorkerPool, index: KvIndex, metrics: RouterMetrics | None,
                           on_new: list | None = None) -> None:
    """Keep one subscription per prefill that registered KV events, for as long as this router runs. `on_new`:
    called with each newly subscribed worker (the policy readies its tokenizer)."""
    context = zmq.asyncio.Context()
    subscriptions: dict[str, tuple[tuple, asyncio.Task]] = {}
    try:
        while True:
            wanted = {w.worker_id: w for w in pool.of_role(Role.PREFILL) if w.kv_events is not None}
            for worker_id, (key, task) in list(subscriptions.items()):
                worker = wanted.get(worker_id)
                if worker is None or _subscribed_as(worker) != key or task.done():
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        log.warning("KV event subscription failed", extra={"worker": worker_id,
                                                                           "error": repr(task.exception())[:300]})
                    task.cancel()
                    del subscriptions[worker_id]
                    index.drop(worker_id)
                    if worker is not None and metrics:
                        metrics.kv_resyncs.labels(worker_id, "new_instance").inc()
            for worker_id, worker in wanted.items():
                if worker_id not in subscriptions:
                    assert worker.kv_events is not None
                    run = Subscription(context, worker, worker.kv_events, index, metrics).run()
                    subscriptions[worker_id] = (_subscribed_as(worker), asyncio.create_task(run))
                    for hook in on_new or ():
                        hook(worker)
            if metrics:
                metrics.set_kv_index_sizes({worker_id: index.size(worker_id) for worker_id in wanted})
            await asyncio.sleep(FOLLOW_INTERVAL)
    finally:
        for _, task in subscriptions.values():
            task.cancel()
        await asyncio.gather(*(task for _, task in subscriptions.values()), return_exceptions=True)
        with contextlib.suppress(zmq.ZMQError):
            context.destroy(linger=0)


def start(policy: Policy, pool: WorkerPool, metrics: RouterMetrics, client: UpstreamClient) -> list[asyncio.Task]:
    """The subscriptions' task, if the prefill policy routes by KV events (router/app.py's start-up). `client`: for
    the policy's calls to workers' /tokenize."""
    if not isinstance(policy, CacheAware):
        return []
    policy.metrics, policy.client = metrics, client
    loading: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def subscribed(worker: Worker) -> None:
        policy.routed.drop(worker.worker_id)  # a new instance (or publisher): what it was sent is not in its memory
        if worker.identity is not None:
            task = asyncio.get_running_loop().create_task(policy.tokens.load(worker.identity.model_path))
            loading.add(task)
            task.add_done_callback(loading.discard)

    return [asyncio.create_task(follow_kv_events(pool, policy.index, metrics, [subscribed]))]
