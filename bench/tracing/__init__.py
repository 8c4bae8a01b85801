"""Tracing's cost to the router, on fake workers: CPU per request with tracing off, on and 1% sampled
(`python -m bench.tracing.cost`, `make bench-tracing`), and the same routers' instructions per request under
callgrind (`python -m bench.tracing.instructions`, `make bench-tracing-instructions`)."""
