"""The store of responses and conversations (router/store/), on SQLite in a temp dir and on a real PostgreSQL started
by the suite (tests/unit/conftest.py's `store_config`: every test runs on both): a 10-turn chain rebuilt exactly, also
after a router restart and through another router; tenant isolation; retention and its sweep; the size bound;
deletion; concurrent writers through two engines."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from sqlalchemy import func, select

from router.config import StoreConfig
from router.store import ItemTooLarge, NewResponse, NotFound, Store, open_store, tenant_of
from router.store.schema import conversation_items, conversations, responses

ALICE, BOB = tenant_of("alice's key"), tenant_of("bob's key")


class Clock:
    """A settable clock: rows age without waiting."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def turn_input(i: int) -> list[dict]:
    # key order, unicode, a NUL, floats and large ints: what must come back byte for byte
    return [{"type": "message", "role": "user", "z_last_first": True,
             "content": [{"type": "input_text", "text": f"turn {i}: ünïcødé ✓ \u0000 \"quoted\""}]},
            {"type": "function_call_output", "call_id": f"call_{i}", "output": orjson.dumps({"t": 0.1 * i}).decode(),
             "big": 2**53 + i, "ratio": 1 / 3}]


def turn_output(i: int) -> list[dict]:
    return [{"type": "message", "id": f"msg_out_{i}", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": f"answer {i}", "annotations": [], "logprobs": [-0.25]}]}]


async def opened(config: StoreConfig, clock: Clock | None = None) -> Store:
    store = await open_store(config, clock or time.time)
    assert store is not None
    return store


async def write_chain(store: Store, tenant: str, turns: int, previous: str | None = None) -> list[str]:
    ids = []
    for i in range(turns):
        stored = await store.responses.put(tenant, NewResponse(
            model="smollm2", status="completed", input_items=turn_input(i), output_items=turn_output(i),
            usage={"input_tokens": 10 * i, "output_tokens": 3}, previous_response_id=previous))
        previous = stored.id
        ids.append(stored.id)
    return ids


def expected_history(turns: int) -> bytes:
    return orjson.dumps([item for i in range(turns) for item in turn_input(i) + turn_output(i)])


async def count(store: Store, table) -> int:
    async with store.db.reads.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(table))).scalar_one()


def test_a_chain_of_10_turns_is_rebuilt_exactly_also_after_a_restart(store_config):
    async def scenario():
        store = await opened(store_config)
        ids = await write_chain(store, ALICE, 10)
        assert orjson.dumps(await store.responses.rebuild_input(ALICE, ids[-1])) == expected_history(10)
        assert orjson.dumps(await store.responses.rebuild_input(ALICE, ids[4])) == expected_history(5)
        first = await store.responses.get(ALICE, ids[0])
        assert first is not None and first.input_items == turn_input(0) and first.previous_response_id is None
        await store.close()
        restarted = await opened(store_config)  # a new engine on the same database: the router restarted
        assert orjson.dumps(await restarted.responses.rebuild_input(ALICE, ids[-1])) == expected_history(10)
        last = await restarted.responses.get(ALICE, ids[-1])
        assert last is not None and last.previous_response_id == ids[-2] and last.usage == {
            "input_tokens": 90, "output_tokens": 3}
        await restarted.close()

    asyncio.run(scenario())


def test_a_chain_written_through_one_router_is_rebuilt_by_another(store_config):
    async def scenario():
        one, other = await asyncio.gather(opened(store_config), opened(store_config))  # both migrate at once
        ids = await write_chain(one, ALICE, 5)
        ids += await write_chain(other, ALICE, 5, previous=ids[-1])  # the conversation moved to the other router
        history = [item for i in [*range(5), *range(5)] for item in turn_input(i) + turn_output(i)]
        for store in (one, other):
            assert orjson.dumps(await store.responses.rebuild_input(ALICE, ids[-1])) == orjson.dumps(history)
        await one.close()
        await other.close()

    asyncio.run(scenario())


def test_another_tenant_finds_nothing_and_changes_nothing(store_config):
    async def scenario():
        store = await opened(store_config)
        ids = await write_chain(store, ALICE, 3)
        conversation, items = await store.conversations.create(ALICE, {"topic": "alice's"}, [{"type": "message"}])
        assert await store.responses.get(BOB, ids[0]) is None
        assert not await store.responses.delete(BOB, ids[0])
        with pytest.raises(NotFound):
            await store.responses.rebuild_input(BOB, ids[-1])
        with pytest.raises(NotFound):  # no continuing another tenant's chain
            await write_chain(store, BOB, 1, previous=ids[-1])
        with pytest.raises(NotFound):
            await store.responses.put(BOB, NewResponse("m", "completed", [], [], conversation_id=conversation.id))
        assert await store.conversations.get(BOB, conversation.id) is None
        assert not await store.conversations.delete(BOB, conversation.id)
        assert await store.conversations.get_item(BOB, conversation.id, items[0].id) is None
        for call in (store.conversations.list_items(BOB, conversation.id),
                     store.conversations.add_items(BOB, conversation.id, [{"type": "message"}]),
                     store.conversations.delete_item(BOB, conversation.id, items[0].id)):
            with pytest.raises(NotFound):
                await call
        bobs, _ = await store.conversations.create(BOB, {}, [])
        with pytest.raises(NotFound):  # Alice's item named in Bob's conversation
            await store.conversations.list_items(BOB, bobs.id, after=items[0].id)
        assert await store.conversations.list_items(BOB, bobs.id) == []
        # all of Alice's is still there, for Alice
        assert orjson.dumps(await store.responses.rebuild_input(ALICE, ids[-1])) == expected_history(3)
        assert [i.item for i in await store.conversations.list_items(ALICE, conversation.id)] == [{"type": "message"}]
        await store.close()

    asyncio.run(scenario())


def test_expired_rows_are_invisible_at_once_and_swept_later(store_config):
    async def scenario():
        clock = Clock()
        store = await opened(store_config, clock)
        ids = await write_chain(store, ALICE, 2)
        old, _ = await store.conversations.create(ALICE, {}, [{"n": 1}])
        clock.now += 20 * 86400
        kept, _ = await store.conversations.create(ALICE, {}, [{"n": 2}])
        clock.now += 9 * 86400
        await store.conversations.add_items(ALICE, kept.id, [{"n": 3}])  # its retention restarts
        clock.now += 2 * 86400  # 31 days after the first rows, 2 after the last write
        assert await store.responses.get(ALICE, ids[0]) is None
        assert await store.conversations.get(ALICE, old.id) is None
        with pytest.raises(NotFound):
            await store.responses.rebuild_input(ALICE, ids[-1])
        with pytest.raises(NotFound):
            await store.conversations.add_items(ALICE, old.id, [{"n": 4}])
        assert await count(store, responses) == 2  # invisible, not yet deleted
        assert await store.sweep() == 3
        assert (await count(store, responses), await count(store, conversations)) == (0, 1)
        assert [i.item for i in await store.conversations.list_items(ALICE, kept.id)] == [{"n": 2}, {"n": 3}]
        assert await count(store, conversation_items) == 2  # the swept conversation's item went with it
        await store.close()

    asyncio.run(scenario())


def test_an_item_over_the_bound_is_refused_by_name_and_nothing_is_written(store_config):
    async def scenario():
        store = await opened(store_config)  # max_item_bytes: 4096
        big = {"type": "message", "content": "x" * 4096}
        at_the_bound = {"c": "y" * (4096 - len(b'{"c":""}'))}
        conversation, _ = await store.conversations.create(ALICE, {}, [at_the_bound])
        for write, field in [
            (store.responses.put(ALICE, NewResponse("m", "completed", [{"ok": 1}, big], [])), "input[1]"),
            (store.responses.put(ALICE, NewResponse("m", "completed", [], [big])), "output[0]"),
            (store.conversations.create(ALICE, {"k": "v" * 5000}), "metadata"),
            (store.conversations.add_items(ALICE, conversation.id, [{"ok": 1}, {"ok": 2}, big]), "items[2]"),
        ]:
            with pytest.raises(ItemTooLarge) as refused:
                await write
            assert refused.value.field == field and refused.value.limit == 4096
            assert str(refused.value).startswith(f"{field} is ")
        assert await count(store, responses) == 0
        assert [i.item for i in await store.conversations.list_items(ALICE, conversation.id)] == [at_the_bound]
        await store.close()

    asyncio.run(scenario())


def test_deletion(store_config):
    async def scenario():
        store = await opened(store_config)
        ids = await write_chain(store, ALICE, 4)
        assert await store.responses.delete(ALICE, ids[1])
        assert await store.responses.get(ALICE, ids[1]) is None
        assert not await store.responses.delete(ALICE, ids[1])
        with pytest.raises(NotFound) as broken:  # the chain through a deleted turn names it
            await store.responses.rebuild_input(ALICE, ids[-1])
        assert broken.value.row_id == ids[1]
        assert orjson.dumps(await store.responses.rebuild_input(ALICE, ids[0])) == expected_history(1)
        conversation, items = await store.conversations.create(ALICE, {"a": 1}, [{"n": n} for n in range(4)])
        assert await store.conversations.delete_item(ALICE, conversation.id, items[1].id)
        assert not await store.conversations.delete_item(ALICE, conversation.id, items[1].id)
        assert await store.conversations.get_item(ALICE, conversation.id, items[1].id) is None
        assert [i.item for i in await store.conversations.list_items(ALICE, conversation.id)] == [
            {"n": 0}, {"n": 2}, {"n": 3}]
        assert await store.conversations.delete(ALICE, conversation.id)
        assert await store.conversations.get(ALICE, conversation.id) is None
        assert await count(store, conversation_items) == 0
        await store.close()

    asyncio.run(scenario())


def test_a_conversations_items_in_order_and_by_page(store_config):
    async def scenario():
        store = await opened(store_config)
        conversation, first = await store.conversations.create(ALICE, {"topic": "t"}, [{"n": 0}, {"n": 1}])
        added = await store.conversations.add_items(ALICE, conversation.id, [{"n": n} for n in range(2, 6)])
        ids = [item.id for item in first + added]
        assert all(i.startswith("msg_") for i in ids) and len(set(ids)) == 6
        listing = store.conversations.list_items
        assert [i.id for i in await listing(ALICE, conversation.id)] == ids
        assert [i.id for i in await listing(ALICE, conversation.id, after=ids[1], limit=2)] == ids[2:4]
        assert [i.id for i in await listing(ALICE, conversation.id, newest_first=True, limit=3)] == ids[:2:-1]
        assert [i.id for i in await listing(ALICE, conversation.id, after=ids[3], newest_first=True)] == ids[2::-1]
        got = await store.conversations.get_item(ALICE, conversation.id, ids[4])
        assert got is not None and got.item == {"n": 4}
        found = await store.conversations.get(ALICE, conversation.id)
        assert found is not None and found.metadata == {"topic": "t"} and found.id.startswith("conv_")
        await store.close()

    asyncio.run(scenario())


def test_concurrent_writers_through_two_engines(store_config):
    async def scenario():
        one, other = await opened(store_config), await opened(store_config)
        conversation, _ = await one.conversations.create(ALICE, {}, [])

        async def writer(store: Store, n: int) -> list[str]:
            for k in range(3):
                await store.conversations.add_items(ALICE, conversation.id, [{"w": n, "k": k, "j": j} for j in (0, 1)])
            return await write_chain(store, ALICE, 3)

        chains = await asyncio.gather(*(writer(one if n % 2 else other, n) for n in range(16)))
        for ids in chains:
            assert orjson.dumps(await one.responses.rebuild_input(ALICE, ids[-1])) == expected_history(3)
        items = [i.item for i in await other.conversations.list_items(ALICE, conversation.id)]
        assert len(items) == 16 * 3 * 2
        for n in range(16):  # each writer's items in the order it wrote them, each batch together
            own = [i for i, item in enumerate(items) if item["w"] == n]
            assert [(items[i]["k"], items[i]["j"]) for i in own] == [(k, j) for k in range(3) for j in (0, 1)]
            assert all(own[2 * k + 1] == own[2 * k] + 1 for k in range(3))
        await one.close()
        await other.close()

    asyncio.run(scenario())
