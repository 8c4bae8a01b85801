"""The typed messages exchanged between workers, the bootstrap service and the router.

This module is the single contract between processes: the bootstrap service validates what workers send with these
models, and the router parses what the bootstrap service lists with them. Nothing else crosses a process boundary
except SGLang's own HTTP API, which the router passes through.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from pdcluster.common.newer import from_newer  # noqa: F401 - where every reader of a message imports it from

BOOTSTRAP_SERVICE_PORT = 8998


class Role(str, Enum):  # noqa: UP042 - a StrEnum's str() and f-strings give the value, not Role.PREFILL: not a drop-in
    PREFILL = "prefill"
    DECODE = "decode"


class _Strict(BaseModel):
    # Unknown fields are refused by model_validate: a sender bug should be loud. A message from a newer peer (a
    # rolling upgrade) is read with `from_newer`, which drops and names them.
    model_config = ConfigDict(extra="forbid")
    # Fields renamed, former name -> name. A message is read under either name (from a peer older than the rename)
    # and written under both, so that an older peer, which knows only the former, reads it too (and drops the new
    # name as a newer peer's field). The former name goes once no peer from before the rename is left.
    RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _read_former_names(cls, data: Any) -> Any:
        if not cls.RENAMED or not isinstance(data, dict):
            return data
        data = dict(data)
        for former, name in cls.RENAMED.items():
            if former in data:
                value = data.pop(former)
                if data.setdefault(name, value) != value:
                    raise ValueError(f"{former} (the former name of {name}) and {name} differ")
        return data

    @model_serializer(mode="wrap")
    def _write_former_names(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for former, name in self.RENAMED.items():
            if isinstance(data, dict) and name in data:
                data[former] = data[name]
        return data


class ModelIdentity(_Strict):
    """What must match between a prefill and a decode for KV pages to mean the same thing on both sides."""

    model_path: str = Field(min_length=1)
    served_model_name: str = Field(min_length=1)
    page_size: int = Field(ge=1)
    kv_cache_dtype: str = Field(min_length=1)
    transfer_backend: str = Field(min_length=1)


class WorkerCapabilities(_Strict):
    """What a worker's SGLang was started with that a request may depend on: the router serves such a request only
    through a pair whose two workers have it (router/pd/pairing.py, `check_for_pair`). Defaults: what a worker that says
    nothing (an older launcher) runs with."""

    # SGLang's --tool-call-parser and --reasoning-parser, by name (the launcher refuses "auto": SGLang resolves it
    # only once it runs); None: it runs none.
    tool_call_parser: str | None = Field(default=None, min_length=1, max_length=64)
    reasoning_parser: str | None = Field(default=None, min_length=1, max_length=64)
    # --enable-deterministic-inference: only then does SGLang sample by a request's seed.
    deterministic_inference: bool = False
    # --enable-priority-scheduling, higher values first (SGLang's default order): only then does the router send a
    # request's `priority` (its tenant's class's, router/admission/tenants.py).
    priority_scheduling: bool = False


class KVStoreMembership(_Strict):
    """The KV namespace a worker reads and writes pages in (pdcluster/kvstore/), and proof of the cluster secret it
    seals them with: the bootstrap service refuses a worker whose proof differs from its namespace's other workers'."""

    namespace: str = Field(pattern=r"^[0-9a-f]{16}$")  # the namespace's fingerprint, its directory's name
    # HMAC-SHA256 keyed by the secret (pdcluster/kvstore/secret_proof.py), never the secret; None: no secret.
    secret_proof: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # Its directory's own id (pdcluster/kvstore/namespace.py, `store-id`): replicas mounting one volume share it, two
    # disks with the same namespace do not. None: unknown (an older launcher): its pages credit no other worker.
    store_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")

    @property
    def store(self) -> str | None:
        """Where its pages are, across workers: the same for every worker reading the same files."""
        return f"{self.namespace}/{self.store_id}" if self.store_id else None


class KVEventsEndpoint(_Strict):
    """Where a worker's SGLang publishes its KV events (--kv-events-config: a ZMQ PUB of the pages its radix cache
    stores and evicts, and a ROUTER that replays missed batches): what a router's cache_aware policy follows."""

    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    replay_port: int | None = Field(default=None, ge=1, le=65535)
    topic: str = Field(default="", max_length=64)


class WorkerFacts(_Strict):
    """What a worker's registration and the router config's static worker (router/config.py) both say of a worker: one
    schema, one name per field."""

    url: HttpUrl
    # A prefill's SGLang KV bootstrap server: decode workers fetch transfer metadata from it. Not the bootstrap service.
    kv_bootstrap_host: str | None = None
    kv_bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    # The model's vocabulary size and context length (a local model folder's config.json; context_length: SGLang's
    # --context-length when set): token ids in requests are checked against them. None: unknown.
    vocab_size: int | None = Field(default=None, ge=1)
    context_length: int | None = Field(default=None, ge=1)
    # A prefill's largest forward pass in prompt tokens (SGLang's chunked_prefill_size): how long it may be silent
    # while it works for any client, other routers' included (router/fleet/liveness.py).
    forward_tokens: int | None = Field(default=None, ge=1)


class WorkerRegistration(WorkerFacts):
    """Sent by a worker's launcher to the bootstrap service once its SGLang server answers. An older launcher sends
    kv_bootstrap_host and kv_bootstrap_port as bootstrap_host and bootstrap_port (RENAMED)."""

    worker_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:@-]+$")
    role: Role
    identity: ModelIdentity
    # From SGLang's /server_info once it serves (None: unknown): the tokens its KV pool holds, and a decode's
    # num_reserved_decode_tokens, which it pre-allocates with every prompt (router/pd/kv_fit.py).
    kv_pool_tokens: int | None = Field(default=None, ge=1)
    reserved_decode_tokens: int | None = Field(default=None, ge=0)
    # Made by the launcher at each start: routers check a new instance (a restarted worker) before it gets traffic.
    instance_id: str | None = Field(default=None, max_length=64)
    capabilities: WorkerCapabilities = Field(default_factory=WorkerCapabilities)
    # None: the worker keeps no KV on disk (or is an older launcher, which says nothing of it).
    kv_store: KVStoreMembership | None = None
    kv_events: KVEventsEndpoint | None = None  # None: it publishes none (a decode, or turned off)
    # Started with SGLang's --enable-pd-role-switch: its role can be flipped live (`python -m bootstrap switch`).
    switch_enabled: bool = False

    RENAMED: ClassVar[dict[str, str]] = {"bootstrap_host": "kv_bootstrap_host", "bootstrap_port": "kv_bootstrap_port"}

    @model_validator(mode="after")
    def _prefill_has_bootstrap(self) -> WorkerRegistration:
        if self.role is Role.PREFILL and (not self.kv_bootstrap_host or self.kv_bootstrap_port is None):
            raise ValueError("a prefill registration needs kv_bootstrap_host and kv_bootstrap_port")
        if self.kv_bootstrap_port == BOOTSTRAP_SERVICE_PORT:
            raise ValueError(f"kv_bootstrap_port {BOOTSTRAP_SERVICE_PORT} belongs to the bootstrap service")
        return self

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    @property
    def prompt_budget(self) -> int | None:
        """The longest prompt (tokens) this decode can ever pre-allocate, when that is shorter than its context
        length; None when every prompt SGLang accepts fits, or when the pool is unknown. A decode pre-allocates the
        prompt, page-aligned, plus its reserve (measured: on an idle 1536-token pool, 1024 + 512 fit, 1025 wait);
        SGLang refuses only prompts longer than the pool, and holds one in that gap until the prefill's bootstrap
        timeout. One page less than that, as a margin: admission also counts pages held for other work (a decode's
        offload to the KV store)."""
        if self.role is not Role.DECODE or self.kv_pool_tokens is None or self.reserved_decode_tokens is None:
            return None
        page = self.identity.page_size
        budget = max(0, (self.kv_pool_tokens - self.reserved_decode_tokens - page) // page * page)
        return budget if self.context_length is None or budget < self.context_length else None


class Heartbeat(_Strict):
    healthy: bool = True
    detail: str = ""


SwitchState = Literal["draining", "switching", "done", "failed"]


class RoleSwitch(_Strict):
    """A worker's role flip (bootstrap/switch.py): drained, then switched by its launcher, then registered anew
    under its new role (done), or given up with the reason (failed). Times are the registry's clock."""

    to: Role
    state: SwitchState
    reason: str = ""
    started: float  # asked for: the drain starts
    switching_at: float | None = None  # SGLang idle: its launcher asks it to switch
    ended: float | None = None


class SwitchRequest(_Strict):
    to: Role


class SwitchProgress(_Strict):
    """A launcher's word on the flip it carries out (its end, `done`, is its registration under the new role)."""

    state: Literal["switching", "failed"]
    reason: str = Field(default="", max_length=2000)


class WorkerStatus(_Strict):
    """One row of the bootstrap service's listing."""

    registration: WorkerRegistration
    healthy: bool
    detail: str = ""
    registered_at: float
    last_heartbeat: float
    # Why this worker can be paired with no worker of the other role; empty when it can.
    incompatible: str = ""
    # Taken out of the routers' pools by an operator (`python -m bootstrap drain`): it keeps running and finishes
    # what it has, but gets no new request until `resume`. Survives the worker's re-registration, not a restart of
    # the bootstrap service.
    draining: bool = False
    switch: RoleSwitch | None = None  # its last role flip, running or ended; None: never flipped


class WorkerListing(_Strict):
    # Moves on every change; starts from the service's start time in ms, so a restarted service never reuses one.
    version: int = Field(ge=0)
    ttl_seconds: float
    # A service younger than its TTL may not have heard from every live worker yet (they re-register within one
    # heartbeat): a follower should not drop workers missing from it until then.
    uptime_seconds: float = 0.0
    workers: list[WorkerStatus]

    @property
    def warming_up(self) -> bool:
        return self.uptime_seconds < self.ttl_seconds


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "upstream_error", "unavailable", "timeout",
    "rate_limit_exceeded", "model_not_found",
]


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """The JSON body of every error the router and the bootstrap service answer with (OpenAI's shape)."""

    error: ErrorDetail
