"""The KV hand-off benchmark (`python -m bench.kv_handoff`, `make bench-kv-handoff`, no SGLang): one prompt's KV moved
between two processes (peers) through Mooncake's TCP transport as SGLang's connector batches it (plan), against a
plain loopback socket moving the same bytes; its ratios, table and picture (report)."""
