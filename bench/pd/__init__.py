"""Where PD pays (`python -m bench.pd`, `make bench-pd`): streams' inter-token latency while long prompts arrive, PD
pinned to a core per worker against one colocated SGLang server; its load (load) and its verdicts (report)."""
