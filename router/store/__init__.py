"""The stored responses and conversations (`store: true`, `previous_response_id`, the Conversations API), in a real
database that outlives a router: SQLite on disk by default, PostgreSQL when several routers share one store.

Owns: the tables (`schema`), their migrations (`migrations`), the connection (`engine`), responses and the rebuild of a
turn's input from its chain (`responses`), conversations and their ordered items (`conversations`), retention
(`store`'s sweep), tenants and ids (`ids`), and what it refuses (`errors`). The routes that use it live above it.

Every read and write is scoped by the tenant (`tenant_of(api_key)`): another tenant's id is not found, as an absent one.

Migrations: SQLAlchemy's metadata plus a schema-version table and an ordered list of migrations (`migrations`), not
alembic. Three tables and two migrations do not justify alembic's weight (Mako, an env.py, a script directory scanned at
every start, a config object) when the router would still write the part that matters at run time itself: the lock
that lets two routers start at once on one PostgreSQL, and the refusal of a newer schema. What alembic's autogenerate
would catch (the code's tables drifting from the migrations') a test catches: it compares a migrated database with
schema.py."""

from router.store.errors import ItemTooLarge, NotFound, SchemaTooNew
from router.store.ids import ANONYMOUS, new_id, tenant_of
from router.store.records import Conversation, ConversationItem, JsonObject, NewResponse, StoredResponse
from router.store.store import Store, open_store

__all__ = [
    "ANONYMOUS", "Conversation", "ConversationItem", "ItemTooLarge", "JsonObject", "NewResponse", "NotFound",
    "SchemaTooNew", "Store", "StoredResponse", "new_id", "open_store", "tenant_of",
]
