"""SGLang's KV events as they come off the wire, read defensively: a worker's publisher is not trusted to be sane.

A message is three ZMQ frames, `[topic, sequence (8 bytes, big-endian), msgpack(EventBatch)]`, and an EventBatch is
the array `[ts, events, attn_dp_rank]` (SGLang 0.5.23, `srt/disaggregation/kv_events.py`). Each event is, in 0.5.23, a
msgpack map tagged by its class name (`{"type": "BlockStored", "block_hashes": ..., ...}`, optional fields left out);
SGLang before that sent positional arrays with the tag first (`["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]`). Both are read. A frame too large, a batch that is not msgpack or not an
EventBatch raises Malformed; an event that makes no sense (a page count that does not match its tokens, ids that are
not integers) is skipped and counted, the batch's other events kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec  # SGLang encodes with it (its dependency, so always there)

MAX_FRAME_BYTES = 16 * 1024 * 1024  # the subscriber also sets it as ZMQ_MAXMSGSIZE: larger is never buffered whole
MAX_EVENTS = 65_536  # per batch
MAX_PAGES = 65_536  # block hashes per event
MEDIA = frozenset({"GPU", "CPU_PINNED", "DISK", "EXTERNAL"})  # SGLang's StorageMedium: HiCache's tiers
DEFAULT_MEDIUM = "GPU"  # what SGLang means by a missing medium
# SGLang's `ZmqEventPublisher.END_SEQ`: the replay socket's last message.
END_OF_REPLAY = -1


class Malformed(ValueError):
    """A message that is not an SGLang KV event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Pages now held in `medium`, chained: the first's parent is `parent` (None: at the root), each next page's the
    one before it. `token_ids` holds `block_size` ids a page (the last page may be shorter)."""

    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class Cleared:
    """The worker dropped its whole cache."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    sequence: int
    events: tuple[Event, ...]
    skipped: int  # events that made no sense
    published: float | None = None  # the publisher's wall clock when it made the batch (SGLang's `ts`)


def sequence_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise Malformed(f"a sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def decode(frames: list[bytes]) -> Batch:
    """One published (or replayed) message: its sequence and events."""
    if len(frames) != 3:
        raise Malformed(f"{len(frames)} frames, not 3 (topic, sequence, payload)")
    sequence = sequence_of(frames[1])
    payload = frames[2]
    if len(payload) > MAX_FRAME_BYTES:
        raise Malformed(f"a payload of {len(payload)} bytes")
    try:
        batch = msgspec.msgpack.decode(payload)
    except Exception as exc:  # DecodeError, and whatever a hostile nesting or extension type may raise
        raise Malformed(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise Malformed("not an EventBatch [ts, events, attn_dp_rank]")
    if len(batch[1]) > MAX_EVENTS:
        raise Malformed(f"{len(batch[1])} events in one batch")
    events, skipped = [], 0
    for raw in batch[1]:
        event = _event(raw)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    published = batch[0] if type(batch[0]) in (float, int) else None
    return Batch(sequence, tuple(events), skipped, published)


# The positional (pre-0.5.23) field order of each event after its tag.
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_POSITIONAL.get(kind, ()), raw[1:], strict=False))
    else:
        return None
    medium = fields.get("medium")
    medium = DEFAULT_MEDIUM if medium is None else medium
    if not isinstance(medium, str) or medium not in MEDIA:
        return None
    if kind == "AllBlocksCleared":
        return Cleared()
    hashes = _ints(fields.get("block_hashes"), MAX_PAGES)
    if not hashes:
        return None
    if kind == "BlockRemoved":
        return Removed(hashes, medium)
    if kind != "BlockStored":
        return None
    parent, size = fields.get("parent_block_hash"), fields.get("block_size")
    tokens = _ints(fields.get("token_ids"), MAX_PAGES * 1024)
    if (parent is not None and not _is_int(parent)) or type(size) is not int or size < 1 or tokens is None:
        return None
    if -(-len(tokens) // size) != len(hashes):  # one hash a page, each page block_size tokens (the last: up to it)
        return None
    return Stored(hashes, parent, tokens, size, medium)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _ints(value: Any, most: int) -> tuple[int, ...] | None:
    if not isinstance(value, list | tuple) or len(value) > most:
        return None
    if not all(type(v) is int for v in value):  # bool is no id; bigram pages (tuples) are not read
        return None
    return tuple(value)
