"""The router benchmark (`python -m bench.router`, `make bench`): our router's own cost next to SGLang's Rust router,
both over fake workers, driven by wrk; and the router's data-plane client against aiohttp's (upstream_client)."""
