"""The Responses store's benchmark (`make bench-store`, `python -m bench.store`): what `store: true` adds to a turn at
the router, on SQLite and on PostgreSQL, next to `store: false`, on FAKE workers."""
