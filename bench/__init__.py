"""Benchmarks of the router against direct access and SGLang's Rust router (see bench/README.md)."""
