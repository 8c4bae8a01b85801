"""What `python -m pdcluster.local` starts (configs/local.yaml): the components, their configs and ports. Validated at
the edge (pydantic); pdcluster/local/cluster.py trusts it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdcluster.common.config_file import load_yaml
from pdcluster.common.sglang_args import SGLANG_RANDOM_PORTS


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

    @model_validator(mode="after")
    def _ports_sglang_never_picks(self) -> LocalSpec:
        """Every worker of this cluster shares the host: none may listen where SGLang picks ports at random."""
        workers = self.prefill.count + self.decode.count  # a switch-enabled decode has KV ports too (cluster.py)
        ports = {"prefill first_port": self.prefill.first_port + self.prefill.count - 1,
                 "decode first_port": self.decode.first_port + self.decode.count - 1,
                 "prefill first_kv_bootstrap_port": self.prefill.first_kv_bootstrap_port + workers - 1,
                 "prefill first_kv_events_port": self.prefill.first_kv_events_port + 2 * workers - 1}
        starts = {"prefill first_port": self.prefill.first_port, "decode first_port": self.decode.first_port,
                  "prefill first_kv_bootstrap_port": self.prefill.first_kv_bootstrap_port,
                  "prefill first_kv_events_port": self.prefill.first_kv_events_port}
        for component in ("bootstrap", "router", "planner"):
            if (spec := getattr(self, component)) is not None and spec.port:
                starts[f"{component} port"] = ports[f"{component} port"] = spec.port
        for what, first in starts.items():
            last, low, high = ports[what], SGLANG_RANDOM_PORTS.start, SGLANG_RANDOM_PORTS.stop - 1
            if first <= high and last >= low:
                raise ValueError(f"{what}: ports {first}-{last} overlap {low}-{high}, where each SGLang worker picks a "
                                 "port at random when it starts (its scheduler's TCPStore): choose ports outside it")
        return self

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
