"""The store's tables as the code reads them (SQLAlchemy Core, one MetaData). migrations.py brings a database to this
shape; tests/unit/test_store.py checks that a migrated database has exactly these columns.

JSON is kept as text written by orjson, not as a JSON/JSONB column: the items come back byte for byte as stored (JSONB
reorders keys) on both backends, and the size bound is measured on the same bytes that are written."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import FromClause

metadata = MetaData()

ID = String(64)  # `resp_` and 48 hex digits, with room
TENANT = String(64)  # a sha256 in hex, or "anonymous"

# The version a database is at (one row); written only by migrations.py, under its lock.
schema_version = Table(
    "pdcluster_schema_version", metadata,
    Column("version", Integer, nullable=False),
)

responses = Table(
    "responses", metadata,
    Column("id", ID, primary_key=True),
    Column("tenant", TENANT, nullable=False),
    Column("created", Float, nullable=False),  # seconds since the epoch
    Column("model", String(256), nullable=False),
    Column("status", String(32), nullable=False),
    Column("input_items", Text, nullable=False),  # this turn's input items only (a JSON array)
    Column("output_items", Text, nullable=False),
    Column("usage", Text, nullable=True),
    # no foreign key: deleting a turn leaves the later ones, whose chain then reads as broken
    Column("previous_response_id", ID, nullable=True),
    Column("conversation_id", ID, nullable=True),
    Column("expires", Float, nullable=False),
    # The request's settings the Response object echoes (instructions, tools, text, ...): a retrieved response is the
    # one created. Null in rows of version 1.
    Column("settings", Text, nullable=True),
)
Index("responses_expires", responses.c.expires)

conversations = Table(
    "conversations", metadata,
    Column("id", ID, primary_key=True),
    Column("tenant", TENANT, nullable=False),
    Column("created", Float, nullable=False),
    Column("metadata", Text, nullable=False),  # a JSON object
    Column("expires", Float, nullable=False),  # retention from the last write
)
Index("conversations_expires", conversations.c.expires)

conversation_items = Table(
    "conversation_items", metadata,
    # The order of a conversation's items: one counter for every conversation (no per-conversation position for two
    # writers to both take); SQLite's INTEGER PRIMARY KEY is its rowid, which only an INTEGER column is.
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("id", ID, nullable=False, unique=True),
    # A deleted (or swept) conversation takes its items along; a write racing the delete fails on this key.
    Column("conversation_id", ID, ForeignKey("conversations.id", ondelete="CASCADE"), nullable=False),
    Column("tenant", TENANT, nullable=False),
    Column("created", Float, nullable=False),
    Column("item", Text, nullable=False),
)
Index("conversation_items_order", conversation_items.c.conversation_id, conversation_items.c.seq)


def visible(table: FromClause, tenant: str, now: float, row_id: str | None = None) -> ColumnElement[bool]:
    """The tenant's unexpired rows of `table` (the one with `row_id`): the condition of every read and write, so that
    another tenant's row and an expired one are alike not found."""
    condition = and_(table.c.tenant == tenant, table.c.expires > now)
    return condition if row_id is None else and_(table.c.id == row_id, condition)
