"""How a worker with `kv_store` names pdcluster's sealed storage to SGLang (backend.py), without importing it.

SGLang's `dynamic` storage backend loads the class its extra config names (`backend_name`, `module_path`,
`class_name`), in every process that builds a HiCache controller: the prefill's scheduler and a decode's offload
manager alike. Those keys are merged into whatever extra config the worker's file sets, so a configured
`prefetch_threshold` or metadata-cache option still applies. The secret travels as a file name (`secret_file`), never
as its value: the command line shows in `ps` and in `--dry-run`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdcluster.common.config_file import ConfigError
from pdcluster.kvstore.page_seal import SecretError, load_secret

BACKEND = "dynamic"
SEALED = {"backend_name": "pdcluster_sealed_file", "module_path": "pdcluster.kvstore.backend",
          "class_name": "SealedFileStorage"}
EXTRA_CONFIG = "hicache_storage_backend_extra_config"

# The budget of SGLang's `timeout` prefetch policy, which the CPU profile sets on a prefill that reads the store
# (pdcluster/worker/plan.py, KV_DEVICE_FLAGS): base + per 1024 tokens asked for, in seconds (SGLang's defaults, 1 and
# 0.25, suit a GPU, where recomputing is cheap).
PREFETCH_BUDGET = {"prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 2.0}


def extra_config(configured: str | None, secret_file: str | None) -> dict[str, Any]:
    """The extra config SGLang gets: the configured one (a JSON object, or none) with the sealed storage named in it.
    A secret file is checked here, so a missing or empty one stops the worker before SGLang's long start-up."""
    try:
        merged = json.loads(configured) if configured else {}
    except ValueError as exc:
        raise ConfigError(f"hicache-storage-backend-extra-config is not JSON: {exc}") from None
    if not isinstance(merged, dict):
        raise ConfigError("hicache-storage-backend-extra-config must be a JSON object")
    merged.update(SEALED)
    if secret_file:
        try:
            load_secret(secret_file)
        except SecretError as exc:
            raise ConfigError(str(exc)) from None
        merged["secret_file"] = str(Path(secret_file).expanduser().resolve())
    return merged


def is_sealed(backend: str | None, configured: str | None) -> bool:
    """Whether SGLang's final options load the sealed storage."""
    try:
        config = json.loads(configured) if configured else {}
    except ValueError:
        return False
    return backend == BACKEND and isinstance(config, dict) and all(config.get(k) == v for k, v in SEALED.items())
