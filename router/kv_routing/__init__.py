"""Routing by KV events: the prefills' published cache (`kv_wire`, `kv_events`) kept as an index of pages
(`kv_index`, `kv_keys`, `kv_routed`), a prompt's token ids as the prefill will see them (`prompt_ids`,
`chat_template`, `token_pieces`), and the `cache_aware` policy that picks the prefill holding the longest prefix."""
