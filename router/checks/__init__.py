"""The trust boundary for what a client sends: every field of every route against its rule (`validation`, the
tables in `inventory/`, which generate docs/limits.md), a batch's items (`batches`) and the chat-specific checks
(`chat_checks`). A request leaves this room as a `Checked` or as a 400 naming the field."""
