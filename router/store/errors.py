"""What the store refuses, shaped for the routes that will answer with it: a missing row is a 404 (also another
tenant's: no existence oracle), an item over the size bound a 400 naming the field."""

from __future__ import annotations


class NotFound(LookupError):
    """No such row for this tenant: absent, expired, deleted, or another tenant's (told apart by nobody)."""

    def __init__(self, kind: str, row_id: str) -> None:
        super().__init__(f"{kind} with id '{row_id}' not found")
        self.kind = kind
        self.row_id = row_id


class ItemTooLarge(ValueError):
    """One item, as JSON, is over the store's bound (`store.max_item_bytes`); `field` names it (`input[3]`)."""

    def __init__(self, field: str, size: int, limit: int) -> None:
        super().__init__(f"{field} is {size} bytes as JSON; a stored item is at most {limit} bytes")
        self.field = field
        self.size = size
        self.limit = limit


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer router: this one does not know its schema, and touches nothing."""
