"""The fields a PD pair needs in every request: where the prefill's KV bootstrap server is, and a room number
that both halves key their transfer state by, plus a request id that lets the router abort either half."""

from __future__ import annotations

import random
from typing import Any

from router.workers import Worker

_ROOM_BITS = 63  # SGLang keys transfers by a non-negative 63-bit room
# Rooms and request ids must be unique, not secret (SGLang's own router draws rooms from `random` too); seeded
# from os.urandom per process, without a system call per request as `secrets` and uuid4 make.
_rng = random.Random()


def new_room() -> int:
    return _rng.getrandbits(_ROOM_BITS)


def inject_pd_fields(body: dict[str, Any], prefill: Worker, batch_size: int | None, request_id: str) -> list[str]:
    """Add bootstrap_host/port/room (lists for a batch: one room per item) and rid; return the rids to abort by.

    A client's own rid is kept, so the client can still abort by it."""
    if batch_size is None:
        body["bootstrap_host"] = prefill.bootstrap_host
        body["bootstrap_port"] = prefill.bootstrap_port
        body["bootstrap_room"] = new_room()
        body.setdefault("rid", request_id)
        return [body["rid"]]
    body["bootstrap_host"] = [prefill.bootstrap_host] * batch_size
    body["bootstrap_port"] = [prefill.bootstrap_port] * batch_size
    body["bootstrap_room"] = [new_room() for _ in range(batch_size)]
    if body.get("rid") is None:
        body["rid"] = [f"{request_id}-{i}" for i in range(batch_size)]
    return list(body["rid"])


def new_request_id() -> str:
    return f"{_rng.getrandbits(128):032x}"
