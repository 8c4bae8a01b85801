"""The `cluster:` section of a worker config: this project's own settings, next to SGLang's options."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Where the bootstrap service listens; None runs the worker unregistered (a router with a static list can use it).
    bootstrap_url: str | None = "http://127.0.0.1:8998"
    # Shared secret for the bootstrap service's writes; PDCLUSTER_TOKEN in the environment is used when unset.
    token: str | None = None
    # The address other processes reach this worker at. Default: SGLang's --host, or this host's name when that is 0.0.0.0.
    advertise_host: str | None = None
    worker_id: str | None = None
    heartbeat_interval: float = Field(default=1.0, gt=0, le=60)
    # auto: CPU profile when torch sees no CUDA device.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # How long SGLang may take to answer /health before the launcher gives up on it.
    ready_timeout: float = Field(default=900.0, gt=0)
    # Extra environment for SGLang, e.g. its PD timeouts (SGLANG_DISAGGREGATION_*); the caller's environment wins.
    env: dict[str, str] = {}
    # First port tried for a prefill's SGLang KV bootstrap server when the config does not set one.
    kv_bootstrap_port_base: int = Field(default=8999, ge=1024, le=65000)

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: object) -> object:
        return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else value

    @field_validator("bootstrap_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/") if value else value

    def resolved_token(self) -> str | None:
        return self.token or os.environ.get("PDCLUSTER_TOKEN") or None
