"""What the bootstrap service is told about a worker (its WorkerRegistration), from the SGLang options plan.py
decided: where it serves, the model identity its KV pages depend on, its KV bootstrap server, and the limits of the
model a router checks requests against."""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path

from pdcluster.common.protocol import ModelIdentity, Role, WorkerCapabilities, WorkerRegistration
from pdcluster.worker.settings import ClusterSettings


def build_registration(role: Role, cluster: ClusterSettings, ns: argparse.Namespace, advertise: str,
                       kv_bootstrap_port: int | None, capabilities: WorkerCapabilities) -> WorkerRegistration:
    """What the bootstrap service is told about this worker (`ns`: SGLang's final options; `advertise`: the address
    other hosts reach it at)."""
    return WorkerRegistration(
        worker_id=cluster.worker_id or f"{role.value}-{advertise}-{ns.port}",
        role=role,
        url=f"http://{advertise}:{ns.port}",
        identity=ModelIdentity(
            model_path=ns.model_path,
            served_model_name=ns.served_model_name or ns.model_path,
            page_size=ns.page_size or 1,
            kv_cache_dtype=ns.kv_cache_dtype,
            transfer_backend=ns.disaggregation_transfer_backend,
        ),
        kv_bootstrap_host=advertise if kv_bootstrap_port is not None else None,
        kv_bootstrap_port=kv_bootstrap_port,
        **model_limits(ns.model_path, ns.context_length),
        instance_id=uuid.uuid4().hex,
        capabilities=capabilities,
    )


def model_limits(model_path: str, context_length: int | None) -> dict[str, int | None]:
    """vocab_size and context_length from a local model folder's config.json (None when unknown)."""
    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}

    def pick(key: str) -> int | None:
        value = config.get(key, text.get(key))
        return value if isinstance(value, int) and value > 0 else None

    return {"vocab_size": pick("vocab_size"), "context_length": context_length or pick("max_position_embeddings")}
