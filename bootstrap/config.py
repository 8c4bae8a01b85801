"""Bootstrap service settings, validated at the edge."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pdcluster.common.config_file import secret_or_env
from pdcluster.common.protocol import BOOTSTRAP_SERVICE_PORT


class BootstrapConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=BOOTSTRAP_SERVICE_PORT, ge=1, le=65535)
    # Shared secret required on writes (register, heartbeat, deregister); PDCLUSTER_TOKEN when unset.
    token: str | None = None
    # A worker missing heartbeats for this long is dropped from the listing.
    ttl_seconds: float = Field(default=5.0, gt=0)
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    log_level: str = "warning"

    def resolved_token(self) -> str | None:
        return secret_or_env(self.token, "PDCLUSTER_TOKEN")
