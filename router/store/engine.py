"""The store's database connection: SQLAlchemy's async engine on aiosqlite or psycopg, set up so that several writers
(tasks, router processes, routers) share one database safely, and a URL that may be logged (no password).

SQLite: WAL, so that readers never wait for the writer; a write transaction takes the write lock at its BEGIN
(IMMEDIATE): a transaction that read first and took the lock only at its first write would fail at once
("database is locked") when another process wrote in between, instead of waiting for its turn (the busy timeout)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, event, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from router.config import StoreConfig

# How long a SQLite writer waits for another one's write lock before failing.
SQLITE_BUSY_TIMEOUT = 30.0
# The execution option that marks the write engine's transactions (SQLite: BEGIN IMMEDIATE).
WRITES = "pdcluster_store_writes"


@dataclass(frozen=True)
class Database:
    """What every part of the store works with: the engines, the clock (a test's own, to age rows) and the limits."""

    reads: AsyncEngine
    writes: AsyncEngine
    retention_seconds: float
    max_item_bytes: int
    clock: Callable[[], float] = time.time

    def expiry(self) -> float:
        """When a row written now stops being visible."""
        return self.clock() + self.retention_seconds


def loggable_url(config: StoreConfig) -> str:
    """The store's URL with its password, if any, masked: the only form of it that is logged or shown."""
    return make_url(config.resolved_url()).render_as_string(hide_password=True)


def create_engines(config: StoreConfig) -> tuple[AsyncEngine, AsyncEngine]:
    """(reads, writes): one pool, two engines; `writes`'s transactions are the ones that take SQLite's write lock at
    BEGIN. A SQLite file's folder is created if missing."""
    url = make_url(config.resolved_url())
    if url.get_backend_name() == "sqlite":
        assert url.database, "StoreConfig refuses a SQLite url without a file"
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, pool_size=config.pool_size, max_overflow=0,
                                     connect_args={"timeout": SQLITE_BUSY_TIMEOUT})
        _sqlite_transactions(engine)
    else:
        # pre-ping: a PostgreSQL restart leaves the pool's connections dead; each is checked once when taken
        engine = create_async_engine(url, pool_size=config.pool_size, max_overflow=0, pool_pre_ping=True)
    return engine, engine.execution_options(**{WRITES: True})


def _sqlite_transactions(engine: AsyncEngine) -> None:
    """The driver's own BEGIN off, ours on (SQLAlchemy's documented recipe for SQLite's transaction modes)."""

    @event.listens_for(engine.sync_engine, "connect")
    def _connected(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        dbapi_connection.isolation_level = None  # type: ignore[attr-defined]  # (the driver issues no BEGIN)
        cursor = dbapi_connection.cursor()
        # WAL and NORMAL: committed rows survive a router's crash (a power cut may lose the last few)
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITES) else "BEGIN")
