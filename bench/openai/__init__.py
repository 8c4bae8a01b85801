"""The OpenAI-compatible surface from a client's side: whether guidellm, a third-party load generator, parses every
answer (`python -m bench.openai.clients`, `make bench-clients`), and what `n` choices cost against one through PD
(`python -m bench.openai.n_choices`, `make bench-n`)."""
