"""Conversations and their items, in order: create, get and delete a conversation; add, list, get and delete items.
Every statement names the tenant and hides expired rows; a conversation's retention runs from its last write, and its
items go with it (the foreign key's cascade)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Row, delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from router.store.engine import Database
from router.store.errors import NotFound
from router.store.ids import new_id
from router.store.records import Conversation, ConversationItem, JsonObject, decode, encode
from router.store.schema import conversation_items, conversations, visible


class Conversations:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, tenant: str, metadata: JsonObject,
                     items: Sequence[JsonObject] = ()) -> tuple[Conversation, list[ConversationItem]]:
        """A new conversation of `tenant`'s, with its first items; ItemTooLarge for metadata or an item."""
        now = self.db.clock()
        conversation = Conversation(id=new_id("conv"), created=now, metadata=metadata)
        row = {"id": conversation.id, "tenant": tenant, "created": now,
               "metadata": encode("metadata", metadata, self.db.max_item_bytes), "expires": self.db.expiry()}
        rows, added = self._item_rows(tenant, conversation.id, items)
        async with self.db.writes.begin() as conn:
            await conn.execute(insert(conversations).values(**row))
            if rows:
                await conn.execute(insert(conversation_items), rows)
        return conversation, added

    async def get(self, tenant: str, conversation_id: str) -> Conversation | None:
        async with self.db.reads.connect() as conn:
            found = (await conn.execute(select(conversations).where(self._mine(tenant, conversation_id)))).first()
        return None if found is None else Conversation(found.id, found.created, decode(found.metadata))

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        """Whether there was such a conversation; its items are gone with it."""
        async with self.db.writes.begin() as conn:
            result = await conn.execute(delete(conversations).where(self._mine(tenant, conversation_id)))
        return result.rowcount > 0

    async def add_items(self, tenant: str, conversation_id: str,
                        items: Sequence[JsonObject]) -> list[ConversationItem]:
        """`items` appended in order, as one write; NotFound, ItemTooLarge. The conversation's retention restarts."""
        rows, added = self._item_rows(tenant, conversation_id, items)
        async with self.db.writes.begin() as conn:
            # First: on PostgreSQL this locks the conversation's row, so that writers append one after the other
            # and a delete waits for them.
            touched = await conn.execute(update(conversations).where(self._mine(tenant, conversation_id))
                                         .values(expires=self.db.expiry()))
            if touched.rowcount == 0:
                raise NotFound("conversation", conversation_id)
            if rows:
                await conn.execute(insert(conversation_items), rows)
        return added

    async def list_items(self, tenant: str, conversation_id: str, *, after: str | None = None,
                         limit: int | None = None, newest_first: bool = False) -> list[ConversationItem]:
        """The conversation's items in the order they were added (or the reverse), those after the item `after` in that
        order, at most `limit`. NotFound for the conversation, or for `after`."""
        items = conversation_items
        query = select(items).where(items.c.conversation_id == conversation_id, items.c.tenant == tenant)
        async with self.db.reads.connect() as conn:
            await self._must_exist(conn, tenant, conversation_id)
            if after is not None:
                start = await self._seq_of(conn, tenant, conversation_id, after)
                query = query.where(items.c.seq < start if newest_first else items.c.seq > start)
            query = query.order_by(items.c.seq.desc() if newest_first else items.c.seq).limit(limit)
            return [_item(row) for row in (await conn.execute(query)).all()]

    async def get_item(self, tenant: str, conversation_id: str, item_id: str) -> ConversationItem | None:
        """The item, while its conversation is visible (an expired conversation's items are not swept yet)."""
        query = select(conversation_items).where(*self._item_of(tenant, conversation_id, item_id))
        async with self.db.reads.connect() as conn:
            try:
                await self._must_exist(conn, tenant, conversation_id)
            except NotFound:
                return None
            found = (await conn.execute(query)).first()
        return None if found is None else _item(found)

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool:
        async with self.db.writes.begin() as conn:
            await self._must_exist(conn, tenant, conversation_id)
            result = await conn.execute(delete(conversation_items)
                                        .where(*self._item_of(tenant, conversation_id, item_id)))
        return result.rowcount > 0

    def _mine(self, tenant: str, conversation_id: str) -> ColumnElement[bool]:
        return visible(conversations, tenant, self.db.clock(), conversation_id)

    @staticmethod
    def _item_of(tenant: str, conversation_id: str, item_id: str) -> tuple[ColumnElement[bool], ...]:
        items = conversation_items
        return items.c.id == item_id, items.c.conversation_id == conversation_id, items.c.tenant == tenant

    def _item_rows(self, tenant: str, conversation_id: str,
                   items: Sequence[JsonObject]) -> tuple[list[dict], list[ConversationItem]]:
        """The rows to insert and what they are to the caller; every item encoded (and bounded) before any write."""
        now, limit = self.db.clock(), self.db.max_item_bytes
        added = [ConversationItem(new_id("msg"), now, item) for item in items]
        rows = [{"id": stored.id, "conversation_id": conversation_id, "tenant": tenant, "created": now,
                 "item": encode(f"items[{i}]", stored.item, limit)} for i, stored in enumerate(added)]
        return rows, added

    async def _must_exist(self, conn: AsyncConnection, tenant: str, conversation_id: str) -> None:
        if (await conn.execute(select(conversations.c.id).where(self._mine(tenant, conversation_id)))).first() is None:
            raise NotFound("conversation", conversation_id)

    async def _seq_of(self, conn: AsyncConnection, tenant: str, conversation_id: str, item_id: str) -> int:
        found = (await conn.execute(select(conversation_items.c.seq)
                                    .where(*self._item_of(tenant, conversation_id, item_id)))).first()
        if found is None:
            raise NotFound("item", item_id)
        return found.seq


def _item(row: Row) -> ConversationItem:
    return ConversationItem(row.id, row.created, decode(row.item))
