"""Stored responses: put, get and delete one, and rebuild the whole input of a turn from its `previous_response_id`
chain. Every statement names the tenant and hides expired rows, so another tenant's or an expired id is not found."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Row, Table, delete, insert, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection

from router.store.engine import Database
from router.store.errors import NotFound
from router.store.records import JsonObject, NewResponse, StoredResponse, decode, encode, encode_items
from router.store.schema import conversations, responses, visible

# The longest chain rebuilt: a bound on the recursive query, far past any conversation a context window holds (a
# longer one reads as broken there).
MAX_CHAIN = 10_000


class Responses:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def put(self, tenant: str, response: NewResponse) -> StoredResponse:
        """Stores `response` for `tenant`. NotFound when its `previous_response_id` or `conversation_id` is not one of
        the tenant's (a chain only ever points back to an existing turn, so it has no cycle); ItemTooLarge."""
        limit = self.db.max_item_bytes
        row = {
            "id": response.id, "tenant": tenant, "created": self.db.clock(), "model": response.model,
            "status": response.status, "input_items": encode_items("input", response.input_items, limit),
            "output_items": encode_items("output", response.output_items, limit),
            "usage": None if response.usage is None else encode("usage", response.usage, limit),
            "previous_response_id": response.previous_response_id, "conversation_id": response.conversation_id,
            "expires": self.db.expiry(),
            "settings": None if response.settings is None else encode("settings", response.settings, limit),
        }
        async with self.db.writes.begin() as conn:
            if response.previous_response_id is not None:
                await self._must_exist(conn, responses, tenant, response.previous_response_id, "response")
            if response.conversation_id is not None:
                await self._must_exist(conn, conversations, tenant, response.conversation_id, "conversation")
            await conn.execute(insert(responses).values(**row))
        return _stored(row)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        mine = visible(responses, tenant, self.db.clock(), response_id)
        async with self.db.reads.connect() as conn:
            found = (await conn.execute(select(responses).where(mine))).first()
        return None if found is None else _stored(found._asdict())

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Whether there was such a response (the later turns of its chain stay, and read as a broken chain)."""
        mine = visible(responses, tenant, self.db.clock(), response_id)
        async with self.db.writes.begin() as conn:
            result = await conn.execute(delete(responses).where(mine))
        return result.rowcount > 0

    async def rebuild_input(self, tenant: str, previous_response_id: str) -> list[JsonObject]:
        """Every earlier turn's input and output items, oldest turn first, as stored: what precedes a new turn's own
        input. One recursive query. NotFound names the first missing turn (deleted, expired or never stored)."""
        now = self.db.clock()
        first = (select(responses.c.id, responses.c.previous_response_id, responses.c.input_items,
                        responses.c.output_items, literal(0).label("depth"))
                 .where(visible(responses, tenant, now, previous_response_id))
                 .cte("chain", recursive=True))
        earlier = responses.alias("earlier")
        chain = first.union_all(
            select(earlier.c.id, earlier.c.previous_response_id, earlier.c.input_items, earlier.c.output_items,
                   first.c.depth + 1)
            .where(earlier.c.id == first.c.previous_response_id, first.c.depth < MAX_CHAIN,
                   visible(earlier, tenant, now)))
        async with self.db.reads.connect() as conn:
            turns = (await conn.execute(select(chain).order_by(chain.c.depth.desc()))).all()
        _whole_chain(turns, previous_response_id)
        items: list[JsonObject] = []
        for turn in turns:
            items += decode(turn.input_items)
            items += decode(turn.output_items)
        return items

    async def _must_exist(self, conn: AsyncConnection, table: Table, tenant: str, row_id: str, kind: str) -> None:
        found = await conn.execute(select(table.c.id).where(visible(table, tenant, self.db.clock(), row_id)))
        if found.first() is None:
            raise NotFound(kind, row_id)


def _whole_chain(turns: Sequence[Row], newest: str) -> None:
    """NotFound for the turn where the chain stops short of its first turn (none found: the newest itself)."""
    if not turns:
        raise NotFound("response", newest)
    oldest_known = turns[0].previous_response_id
    if oldest_known is not None:
        raise NotFound("response", oldest_known)


def _stored(row: dict) -> StoredResponse:
    return StoredResponse(
        id=row["id"], created=row["created"], model=row["model"], status=row["status"],
        input_items=decode(row["input_items"]), output_items=decode(row["output_items"]),
        usage=None if row["usage"] is None else decode(row["usage"]),
        previous_response_id=row["previous_response_id"], conversation_id=row["conversation_id"],
        expires=row["expires"], settings=None if row["settings"] is None else decode(row["settings"]))
