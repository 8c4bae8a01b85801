"""The store's schema and settings (router/store/): migrations that bring an empty database to schema.py's tables,
idempotent and safe for routers starting at once, refusing a newer schema; the config's checks (no password in what
is logged or refused); tenants and ids. On both backends where a database is involved (tests/unit/conftest.py)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time

import pytest
from pydantic import ValidationError
from sqlalchemy import insert, inspect, select, update

from router.config import DEFAULT_SQLITE_URL, RouterConfig, StoreConfig
from router.store import ANONYMOUS, SchemaTooNew, new_id, open_store, tenant_of
from router.store.engine import create_engines, loggable_url
from router.store.migrations import LATEST, MIGRATIONS, migrate
from router.store.schema import metadata, responses, schema_version


def columns(sync_conn) -> dict[str, dict[str, bool]]:
    found = inspect(sync_conn)
    return {table: {c["name"]: c["nullable"] for c in found.get_columns(table)} for table in found.get_table_names()}


def test_a_migrated_database_has_exactly_the_codes_tables(store_config):
    async def scenario():
        reads, writes = create_engines(store_config)
        assert await migrate(writes) == LATEST
        async with reads.connect() as conn:
            migrated = await conn.run_sync(columns)
        await reads.dispose()
        return migrated

    migrated = asyncio.run(scenario())
    expected = {table.name: {c.name: bool(c.nullable) for c in table.columns} for table in metadata.sorted_tables}
    assert migrated == expected


def test_migrations_are_idempotent_and_safe_with_routers_starting_at_once(store_config):
    async def scenario():
        stores = await asyncio.gather(*(open_store(store_config) for _ in range(4)))
        again = await open_store(store_config)
        for store in [*stores, again]:
            assert store is not None
            async with store.db.reads.connect() as conn:
                assert (await conn.execute(select(schema_version.c.version))).scalars().all() == [LATEST]
            await store.close()

    asyncio.run(scenario())


def test_a_database_migrated_by_a_newer_router_is_refused_untouched(store_config):
    async def scenario():
        store = await open_store(store_config)
        assert store is not None
        async with store.db.writes.begin() as conn:
            await conn.execute(update(schema_version).values(version=LATEST + 1))
        await store.close()
        with pytest.raises(SchemaTooNew, match=f"version {LATEST + 1}"):
            await open_store(store_config)

    asyncio.run(scenario())


def test_a_sqlite_files_folder_is_made_and_backend_none_stores_nothing(tmp_path):
    config = StoreConfig(url=f"sqlite+aiosqlite:///{tmp_path}/a/b/responses.db")

    async def scenario():
        store = await open_store(config)
        assert store is not None
        await store.close()
        assert await open_store(StoreConfig(backend="none")) is None

    asyncio.run(scenario())
    assert (tmp_path / "a" / "b" / "responses.db").is_file()


def test_the_default_is_sqlite_on_disk_under_the_gitignored_var():
    config = RouterConfig().store
    assert (config.backend, config.url, config.resolved_url()) == ("sqlite", None, DEFAULT_SQLITE_URL)
    assert DEFAULT_SQLITE_URL == "sqlite+aiosqlite:///var/router/responses.db"


@pytest.mark.parametrize(("settings", "refused"), [
    ({"backend": "postgresql"}, "backend postgresql needs a url"),
    ({"backend": "postgresql", "url": "postgresql://u:hunter2@db/x"}, "postgresql+psycopg://"),
    ({"backend": "sqlite", "url": "postgresql+psycopg://u:hunter2@db/x"}, "sqlite+aiosqlite:///"),
    ({"url": "sqlite+aiosqlite:///:memory:"}, "kept on disk"),
    ({"retention_days": 0}, "greater than or equal to 1"),
    ({"max_item_bytes": 10}, "greater than or equal to 1024"),
    ({"pool_size": 0}, "greater than or equal to 1"),
    ({"backend": "redis"}, "'sqlite', 'postgresql' or 'none'"),
])
def test_the_config_refuses_what_cannot_work_without_quoting_a_password(settings, refused):
    with pytest.raises(ValidationError) as error:
        RouterConfig.model_validate({"store": settings})
    message = error.value.errors()[0]["msg"]
    assert refused in message and "hunter2" not in message


def test_the_logged_url_masks_the_password():
    config = StoreConfig(backend="postgresql", url="postgresql+psycopg://pd:hunter2@db.internal:5432/store")
    assert loggable_url(config) == "postgresql+psycopg://pd:***@db.internal:5432/store"
    assert loggable_url(StoreConfig()) == DEFAULT_SQLITE_URL


def test_a_tenant_is_the_keys_sha256_never_the_key():
    assert tenant_of("sk-secret") == hashlib.sha256(b"sk-secret").hexdigest()
    assert tenant_of(None) == tenant_of("") == ANONYMOUS
    assert tenant_of("a") != tenant_of("b") and len(tenant_of("a")) == 64


def test_ids_are_made_by_the_router_in_openais_shape():
    ids = {new_id(prefix) for prefix in ("resp", "conv", "msg") for _ in range(100)}
    assert len(ids) == 300
    assert all(re.fullmatch(r"(resp|conv|msg)_[0-9a-f]{48}", i) for i in ids)
    with pytest.raises(ValueError, match="unknown id prefix"):
        new_id("chatcmpl")


def test_a_version_1_database_is_migrated_and_its_responses_still_read(store_config):
    """Version 2 added responses.settings: a row stored by a version 1 router reads, without settings."""
    async def scenario():
        reads, writes = create_engines(store_config)
        async with writes.begin() as conn:
            await conn.run_sync(lambda sync: MIGRATIONS[0].apply(sync))
            await conn.run_sync(lambda sync: schema_version.create(sync))
            await conn.execute(insert(schema_version).values(version=1))
            await conn.execute(insert(responses).values(
                id="resp_1", tenant="t", created=1.0, model="m", status="completed", input_items="[]",
                output_items="[]", expires=time.time() + 60))
        await reads.dispose()
        store = await open_store(store_config)
        assert store is not None
        found = await store.responses.get("t", "resp_1")
        await store.close()
        return found

    found = asyncio.run(scenario())
    assert found is not None and found.settings is None and found.model == "m"
