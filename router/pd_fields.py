"""The fields a PD pair needs in every request: where the prefill's KV bootstrap server is, a room number that both
halves key their transfer state by, and the request ids (rids) the router aborts either half by.

Every rid SGLang sees is made here, fresh for every attempt and every batch item, and all of the same length:
SGLang aborts every request whose rid *starts with* the given one, so a rid chosen by a client, or one that is a
prefix of another, could abort other clients' requests. A client's own id is only logged and echoed back.
"""

from __future__ import annotations

import random
from typing import Any

from router.workers import Worker

_ROOM_BITS = 63  # SGLang keys transfers by a non-negative 63-bit room
# Rooms and rids must be unique, not secret (SGLang's own router draws rooms from `random` too); seeded from
# os.urandom per process, without a system call per request as `secrets` and uuid4 make.
_rng = random.Random()


def new_room() -> int:
    return _rng.getrandbits(_ROOM_BITS)


def new_rid() -> str:
    """32 hex digits: fixed length, so no rid is a prefix of another; 128 random bits, so none repeats."""
    return f"{_rng.getrandbits(128):032x}"


def add_pd_fields(body: dict[str, Any], prefill: Worker, batch_size: int | None) -> list[str]:
    """Set SGLang's bootstrap_host/port/room (lists for a batch: one room per item) and fresh rids (replacing any the
    client sent, and those of an earlier attempt); return the rids to abort by."""
    if batch_size is None:
        body["bootstrap_host"] = prefill.kv_bootstrap_host
        body["bootstrap_port"] = prefill.kv_bootstrap_port
        body["bootstrap_room"] = new_room()
        body["rid"] = rid = new_rid()
        return [rid]
    body["bootstrap_host"] = [prefill.kv_bootstrap_host] * batch_size
    body["bootstrap_port"] = [prefill.kv_bootstrap_port] * batch_size
    body["bootstrap_room"] = [new_room() for _ in range(batch_size)]
    body["rid"] = rids = [new_rid() for _ in range(batch_size)]
    return list(rids)
