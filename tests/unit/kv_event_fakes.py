"""What SGLang's prefills send, for the KV-event tests: batches encoded by SGLang's own classes (the 0.5.23 tagged
maps), the same in the positional arrays of older SGLang, and a fake publisher (PUB + replay ROUTER) on loopback."""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from pdcluster.common.protocol import KVEventsEndpoint, ModelIdentity, Role
from router.fleet.workers import Worker, WorkerPool
from tests.fakes import ServerThread

PAGE = 4


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=PAGE, lora_id=None,
                       medium=medium)


def removed(hashes: list[int], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


def payload(events: list[Any], ts: float = 1.0) -> bytes:
    """As SGLang 0.5.23 sends a batch (`ts`: when it was made, by the publisher's clock)."""
    return msgspec.msgpack.encode(KVEventBatch(ts=ts, events=events))


def positional_payload(events: list[Any]) -> bytes:
    """As SGLang before 0.5.23 sent it: each event an array, its tag first."""
    arrays = []
    for e in events:
        if isinstance(e, BlockStored):
            arrays.append(["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                           e.medium])
        elif isinstance(e, BlockRemoved):
            arrays.append(["BlockRemoved", e.block_hashes, e.medium])
        else:
            arrays.append(["AllBlocksCleared"])
    return msgspec.msgpack.encode([1.0, arrays, 0])


def frames(sequence: int, events: list[Any], topic: bytes = b"", ts: float = 1.0) -> list[bytes]:
    return [topic, sequence.to_bytes(8, "big"), payload(events, ts)]


class FakePublisher:
    """A PUB socket and, in a thread, a replay ROUTER that answers as SGLang's ZmqEventPublisher does."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = self.context.socket(zmq.ROUTER)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def publish(self, sequence: int, events: list[Any], live: bool = True) -> None:
        """`live=False`: buffered for replay only (a batch the subscriber lost)."""
        data = payload(events)
        self.buffer.append((sequence, data))
        if live:
            self.pub.send_multipart([b"", sequence.to_bytes(8, "big"), data])

    def send_raw(self, parts: list[bytes]) -> None:
        self.pub.send_multipart(parts)

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.replay.poll(50):
                continue
            client, _, start = self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for sequence, data in list(self.buffer):
                if sequence >= first:
                    self.replay.send_multipart([client, b"", b"", sequence.to_bytes(8, "big"), data])
            self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.context.destroy(linger=0)  # closes both sockets; term() alone would wait for them


def served_pool(stack: ExitStack, prefills: list[Any], decode: Any, publishers: list[FakePublisher],
                identity: ModelIdentity) -> WorkerPool:
    """Fake prefills publishing their KV events (p0, p1, ...) and a fake decode (d0), each served on a thread, in a
    pool as a registry would list them; all closed when `stack` is."""
    stack.callback(lambda: [publisher.close() for publisher in publishers])
    servers = [stack.enter_context(ServerThread(worker.app())) for worker in (*prefills, decode)]
    pool = WorkerPool(admission_check=False)
    for i, (server, publisher) in enumerate(zip(servers, publishers, strict=False)):
        events = KVEventsEndpoint(host="127.0.0.1", port=publisher.port, replay_port=publisher.replay_port)
        pool.workers[f"p{i}"] = Worker(f"p{i}", Role.PREFILL, server.url, "127.0.0.1", 9000 + i, identity=identity,
                                       instance_id="i", kv_events=events)
    pool.workers["d0"] = Worker("d0", Role.DECODE, servers[-1].url, identity=identity)
    return pool
