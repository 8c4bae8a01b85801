"""The chaos soak (`make chaos`, `python -m tests.chaos`): faults one at a time under load on a local 2P+2D cluster,
every answer checked against `transformers`. It lives with the tests because it is a correctness check that shares
their reference model and prompts (tests/e2e/reference.py, prompts.py); it is a program, not a pytest suite (~10 min,
a cluster of its own): tests/conftest.py keeps pytest out of this folder. Its last run: tests/chaos/results/."""
