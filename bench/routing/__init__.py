"""The routing benchmarks: the prefill policies and SGLang's cache-aware router against an oracle on a multi-tenant
workload (`python -m bench.routing`, `make bench-routing`; its load in load, its scoring in report, where a run's TTFT
went in phases), cache_aware across restarts (restarts) and a routing decision's cost in the router's process
(decision)."""
