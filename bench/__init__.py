"""pdcluster's benchmarks, one package per benchmark (router, tracing, cluster, pd, persistence, cpu_attention,
kv_handoff, routing, openai) around one shared harness (harness); bench/README.md says what each answers and shows
its results from bench/results/, rendered by bench/tables.py."""
