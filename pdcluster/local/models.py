"""The two models `make setup` puts in models/, and the worker options that serve a model other than a config's.

- SmolLM2-135M-Instruct (scripts/fetch_smollm2.py): a real, trained model, the default of `make up`, compose's cpu
  profile and the Helm chart's values-cpu.yaml. 30 layers: 45 KiB of float32 KV per token.
- tiny-llama (scripts/build_demo_model.py): 2 layers of random weights, gibberish in milliseconds; the model of the
  fast end-to-end suites, the fault tests and the benchmarks that measure the cluster rather than the model.
"""

from __future__ import annotations

from pathlib import Path

SMOLLM2 = "models/smollm2-135m-instruct"
DEMO = "models/tiny-llama"


def model_args(model: str) -> list[str]:
    """SGLang options that serve `model` (a folder, relative to the working directory or absolute, or a hub id on a
    connected machine) instead of a worker config's own: its path and the name clients ask for (the folder's name, or
    the id)."""
    name = Path(model).name if Path(model).expanduser().is_dir() else model
    return ["--model-path", model, "--served-model-name", name]


# The demo model as its suites have always run it: the CPU profile's KV pool is sized for SmolLM2 (16384 tokens), the
# demo model's was 65536 (at 1 KiB a token: 64 MiB).
DEMO_ARGS = [*model_args(DEMO), "--max-total-tokens", "65536"]
