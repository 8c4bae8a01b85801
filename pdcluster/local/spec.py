"""What `python -m pdcluster.local` starts (configs/local.yaml): the components, their configs and ports. Validated at
the edge (pydantic); pdcluster/local/cluster.py trusts it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pdcluster.common.config_file import load_yaml


class ComponentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: what the component's config says


class WorkerGroupSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: str
    # SGLang options over the config file's, for every worker of the group, as on the launcher's command line (e.g.
    # pdcluster.local.models.model_args: another model)
    args: list[str] = Field(default_factory=list)
    count: int = Field(default=1, ge=0)
    first_port: int = Field(ge=1024, le=65000)
    first_kv_bootstrap_port: int = Field(default=8999, ge=1024, le=65000)
    first_kv_events_port: int = Field(default=5557, ge=1024, le=65000)  # prefills: 2 ports each (events, replay)


class LocalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bootstrap: ComponentSpec
    router: ComponentSpec
    prefill: WorkerGroupSpec
    decode: WorkerGroupSpec
    planner: ComponentSpec | None = None  # the SLO planner (`make up PLANNER=1`); None: not started
    log_dir: str = "logs"
    ready_timeout: float = 600.0

    def _port(self, component: ComponentSpec, default: int) -> int:
        if component.port:
            return component.port
        return int(load_yaml(component.config).get("port", default))

    @property
    def bootstrap_url(self) -> str:
        return f"http://{self.bootstrap.host}:{self._port(self.bootstrap, 8998)}"

    @property
    def router_url(self) -> str:
        return f"http://{self.router.host}:{self._port(self.router, 8000)}"
