"""What the store hands out and takes in (plain dataclasses, no database types), and the JSON text that items are
kept as, where the size bound is measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from router.store.errors import ItemTooLarge
from router.store.ids import new_id

# An item (input, output or conversation item) or metadata: a JSON object as the client's JSON decoder made it.
JsonObject = dict[str, Any]


@dataclass(frozen=True)
class NewResponse:
    """A response to store. Its id is made here (the route makes one early, to name the response while it streams);
    `input_items` are this turn's only: the earlier turns' are in the `previous_response_id` chain."""

    model: str
    status: str
    input_items: list[JsonObject]
    output_items: list[JsonObject]
    usage: JsonObject | None = None
    previous_response_id: str | None = None
    conversation_id: str | None = None
    id: str = field(default_factory=lambda: new_id("resp"))
    settings: JsonObject | None = None  # the request's settings the Response object echoes


@dataclass(frozen=True)
class StoredResponse:
    id: str
    created: float
    model: str
    status: str
    input_items: list[JsonObject]
    output_items: list[JsonObject]
    usage: JsonObject | None
    previous_response_id: str | None
    conversation_id: str | None
    expires: float
    settings: JsonObject | None = None  # None: stored without (or by a router of schema version 1)


@dataclass(frozen=True)
class Conversation:
    id: str
    created: float
    metadata: JsonObject


@dataclass(frozen=True)
class ConversationItem:
    """A conversation's item as given, and the id the store gave it (`msg_...`; the route shows it as the item's)."""

    id: str
    created: float
    item: JsonObject


def encode(field_name: str, value: object, limit: int) -> str:
    """`value` as the JSON text kept in the database; ItemTooLarge naming `field_name` when it is over `limit` bytes."""
    data = orjson.dumps(value)
    if len(data) > limit:
        raise ItemTooLarge(field_name, len(data), limit)
    return data.decode()


def encode_items(field_name: str, items: Sequence[JsonObject], limit: int) -> str:
    """A list of items as one JSON array, each item held to `limit` on its own (`field_name[i]` names the one over)."""
    return "[" + ",".join(encode(f"{field_name}[{i}]", item, limit) for i, item in enumerate(items)) + "]"


def decode(text: str) -> Any:
    return orjson.loads(text)
