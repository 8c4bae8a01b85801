"""The schema's version and the ordered migrations that bring a database to it, run by every router at start.

Idempotent: a database at the latest version is left alone. Safe with several routers starting at once: all of it is
one transaction under a lock, PostgreSQL's transaction-scoped advisory lock (taken before anything else, so even the
version table's creation is serialized) or SQLite's write lock (BEGIN IMMEDIATE); the second router waits, then finds
the work done. PostgreSQL's and SQLite's DDL is transactional: a failed migration leaves the previous version whole.
A database at a version this router does not know (a newer router migrated it) is refused, untouched.

A new migration is appended to MIGRATIONS with the next version, and schema.py changed to match; the first migration
creates version 1's tables as they were (copied here when version 2 changed schema.py), so that every later
migration finds the schema it changes (the test that compares a migrated database with schema.py checks the sum)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Column, Connection, Float, Index, MetaData, String, Table, Text, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from router.store import schema
from router.store.errors import SchemaTooNew

# pg_advisory_xact_lock's key: any constant of our own ("pdcl" "stor" as bytes), the same in every router.
ADVISORY_LOCK_KEY = 0x7064636C73746F72


@dataclass(frozen=True)
class Migration:
    version: int
    what: str
    apply: Callable[[Connection], None]


# Version 1's tables, as they were: schema.py's before version 2 added responses.settings (the conversations' tables
# are unchanged since).
_V1 = MetaData()
_V1_RESPONSES = Table(
    "responses", _V1,
    Column("id", schema.ID, primary_key=True),
    Column("tenant", schema.TENANT, nullable=False),
    Column("created", Float, nullable=False),
    Column("model", String(256), nullable=False),
    Column("status", String(32), nullable=False),
    Column("input_items", Text, nullable=False),
    Column("output_items", Text, nullable=False),
    Column("usage", Text, nullable=True),
    Column("previous_response_id", schema.ID, nullable=True),
    Column("conversation_id", schema.ID, nullable=True),
    Column("expires", Float, nullable=False),
)
Index("responses_expires", _V1_RESPONSES.c.expires)
schema.conversations.to_metadata(_V1)
schema.conversation_items.to_metadata(_V1)


def _create_responses_and_conversations(conn: Connection) -> None:
    _V1.create_all(conn, checkfirst=False)


def _add_response_settings(conn: Connection) -> None:
    conn.execute(text("ALTER TABLE responses ADD COLUMN settings TEXT"))


MIGRATIONS = [
    Migration(1, "responses, conversations and their items", _create_responses_and_conversations),
    Migration(2, "responses.settings: the request's settings a retrieved response echoes", _add_response_settings),
]
LATEST = MIGRATIONS[-1].version


async def migrate(writer: AsyncEngine) -> int:
    """Brings the database to LATEST; the version it is at after. `writer`: the engine whose transactions take
    SQLite's write lock at BEGIN (router/store/engine.py)."""
    async with writer.begin() as conn:
        return await conn.run_sync(_migrate_locked)


def _migrate_locked(conn: Connection) -> int:
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
    schema.schema_version.create(conn, checkfirst=True)
    current = conn.execute(select(schema.schema_version.c.version)).scalar()
    if current is None:
        conn.execute(insert(schema.schema_version).values(version=0))
        current = 0
    if current > LATEST:
        raise SchemaTooNew(f"the store's database is at schema version {current}; this router knows up to {LATEST}")
    for migration in MIGRATIONS:
        if migration.version > current:
            migration.apply(conn)
            conn.execute(update(schema.schema_version).values(version=migration.version))
            current = migration.version
    return current
