"""The store as the router holds it: opened at start (engines made, schema migrated), its two halves (`responses`,
`conversations`), the retention sweep, closed at the end."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sqlalchemy import delete

from router.config import StoreConfig
from router.store.conversations import Conversations
from router.store.engine import Database, create_engines, loggable_url
from router.store.migrations import migrate
from router.store.responses import Responses
from router.store.schema import conversations, responses

log = logging.getLogger("pdcluster.router")

# Expired rows are already invisible; the sweep only gives their space back, so it need not run often.
SWEEP_INTERVAL = 600.0
DAY = 86400.0


class Store:
    def __init__(self, db: Database, url: str) -> None:
        self.db = db
        self.url = url  # loggable: no password
        self.responses = Responses(db)
        self.conversations = Conversations(db)

    async def sweep(self) -> int:
        """Deletes every expired response and conversation (with its items); how many rows of the two."""
        now = self.db.clock()
        async with self.db.writes.begin() as conn:
            gone = await conn.execute(delete(responses).where(responses.c.expires <= now))
            gone_conversations = await conn.execute(delete(conversations).where(conversations.c.expires <= now))
        return gone.rowcount + gone_conversations.rowcount

    async def sweep_forever(self, interval: float = SWEEP_INTERVAL) -> None:
        """The periodic sweep, as a task the router runs for as long as it serves; a failed sweep is logged and tried
        again next time (the database may be away for a while)."""
        while True:
            try:
                swept = await self.sweep()
                if swept:
                    log.info("store: expired rows deleted", extra={"rows": swept})
            except Exception as exc:
                log.warning("store: the retention sweep failed; next try in %.0f s: %s", interval, exc)
            await asyncio.sleep(interval)

    async def close(self) -> None:
        await self.db.reads.dispose()


async def open_store(config: StoreConfig, clock: Callable[[], float] = time.time) -> Store | None:
    """The store `config` names, its schema migrated to this router's version; None for `backend: none`."""
    if config.backend == "none":
        return None
    reads, writes = create_engines(config)
    db = Database(reads, writes, retention_seconds=config.retention_days * DAY,
                  max_item_bytes=config.max_item_bytes, clock=clock)
    url = loggable_url(config)
    try:
        version = await migrate(writes)
    except BaseException:
        await reads.dispose()
        raise
    log.info("store: %s at schema version %d", url, version)
    return Store(db, url)
