"""Router settings, validated at the edge."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdcluster.common.config_file import secret_or_env
from pdcluster.common.protocol import WorkerFacts


# The load-balancing policies are router/pd/policies.py's REGISTRY, which this module, the router's lowest, cannot
# import: whoever loads a config passes their names as pydantic's validation context, {"policies": names}
# (router/__main__.py). A config made without one (in code) is checked when the app makes its policies (make_policy).
def check_policy(name: str, known: Collection[str]) -> str:
    if name not in known:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(known))}")
    return name


def _known_policy(name: str, info: ValidationInfo) -> str:
    known = info.context.get("policies") if isinstance(info.context, dict) else None
    return name if known is None else check_policy(name, known)


PolicyName = Annotated[str, AfterValidator(_known_policy)]


class StaticWorker(WorkerFacts):
    """A worker listed in the router config instead of (or besides) discovered from the bootstrap service: the fields
    a registration has (WorkerFacts: its url, KV bootstrap server, vocab_size, context_length, forward_tokens; without
    vocab_size, requests given as token ids are refused), and what its SGLang runs with."""

    # What its SGLang runs with (discovered workers register these): --tool-call-parser's name, for tool calling,
    # --reasoning-parser's, for the reasoning fields, --enable-deterministic-inference, for seeds (requests that need
    # them are refused through a pair without them), and --enable-priority-scheduling (higher first).
    tool_call_parser: str | None = Field(default=None, min_length=1, max_length=64)
    reasoning_parser: str | None = Field(default=None, min_length=1, max_length=64)
    deterministic_inference: bool = False
    priority_scheduling: bool = False

    @field_validator("url")
    @classmethod
    def _plain_http(cls, url: HttpUrl) -> HttpUrl:
        # workers sit on the cluster's own network; router/transport/upstream.py speaks plain HTTP
        if url.scheme != "http":
            raise ValueError(f"{url}: workers are reached over http://, not {url.scheme}://")
        return url


# Where `make up` (run from the checkout) and a router started from the checkout keep the store: the git-ignored var/.
DEFAULT_SQLITE_URL = "sqlite+aiosqlite:///var/router/responses.db"
STORE_URL_SCHEMES = {"sqlite": "sqlite+aiosqlite:///", "postgresql": "postgresql+psycopg://"}


class StoreConfig(BaseModel):
    """Stored responses and conversations (router/store/): SQLite on disk, PostgreSQL for routers sharing one store."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["sqlite", "postgresql", "none"] = "sqlite"
    # sqlite: unset is DEFAULT_SQLITE_URL (a relative path is the router's working directory's; its folder is made);
    # postgresql: required. A password in it is never logged (better: a .pgpass or PGPASSWORD, which libpq reads).
    url: str | None = None
    # Stored rows are invisible once this old and deleted by the store's periodic sweep.
    retention_days: int = Field(default=30, ge=1, le=36500)
    # The largest item (an input or output item, a conversation item, metadata) as JSON: over it, a 400.
    max_item_bytes: int = Field(default=1024 * 1024, ge=1024)
    # Database connections per router process.
    pool_size: int = Field(default=5, ge=1, le=100)

    @model_validator(mode="after")
    def _url_fits_backend(self) -> StoreConfig:
        # the messages never quote the url: it may hold a password
        if self.backend == "none":
            return self
        scheme = STORE_URL_SCHEMES[self.backend]
        if self.backend == "postgresql" and not self.url:
            raise ValueError(f"backend postgresql needs a url ({scheme}user@host:5432/database)")
        if self.url and not self.url.startswith(scheme):
            raise ValueError(f"url: backend {self.backend} takes a url starting with {scheme}")
        if self.backend == "sqlite" and ":memory:" in self.resolved_url():
            raise ValueError("url: the store is kept on disk (an in-memory SQLite is one per connection)")
        return self

    def resolved_url(self) -> str:
        """The database's URL (the default SQLite file when unset)."""
        return self.url or DEFAULT_SQLITE_URL


class PriorityClass(BaseModel):
    """A priority class of admission (router/admission/gate.py): its bound on a new request's predicted prefill wait,
    and the router's queue for the requests over it (FIFO; after queue_wait seconds, or with the queue full: a 429)."""

    model_config = ConfigDict(extra="forbid")
    # Served first among the classes with requests queued (higher first).
    priority: int = Field(default=0, ge=-1000, le=1000)
    max_predicted_wait: float = Field(default=20.0, gt=0)  # seconds
    queue_length: int = Field(default=256, ge=0)
    queue_wait: float = Field(default=10.0, ge=0)  # seconds; 0: over the bound is a 429 at once


class AdmissionConfig(BaseModel):
    """Admission by predicted wait (router/admission/gate.py, router/admission/queue_wait.py)."""

    model_config = ConfigDict(extra="forbid")
    # Off unless asked for: a cluster pushed past the bound on purpose (a profile run) would get 429s.
    enabled: bool = False
    # A capacity profile (`make profile`: configs/profiles/); its rates are the start of the prefills of its model
    # (matched by served model name) until they are measured. Unset: every prefill starts at unmeasured_tokens_per_s.
    profile: str | None = None
    unmeasured_tokens_per_s: float = Field(default=100.0, gt=0)
    # SGLANG_DISAGGREGATION_WAITING_TIMEOUT as the launchers set it (configs/decode.yaml): every class's bound is at
    # most half of it, so that an admitted request's decode never waits out its KV.
    kv_wait_timeout: float = Field(default=60.0, gt=0)
    classes: dict[str, PriorityClass] = Field(default_factory=lambda: {"default": PriorityClass()})

    @model_validator(mode="after")
    def _bounds_under_kv_timeout(self) -> AdmissionConfig:
        if "default" not in self.classes:
            raise ValueError("classes: a class named 'default' is required (requests of no tenant)")
        for name, klass in self.classes.items():
            if klass.max_predicted_wait > self.kv_wait_timeout / 2:
                raise ValueError(f"classes.{name}.max_predicted_wait ({klass.max_predicted_wait}s) must be at most "
                                 f"half of kv_wait_timeout ({self.kv_wait_timeout}s)")
        return self


Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class TenantConfig(BaseModel):
    """A tenant (router/admission/tenants.py): its API keys as sha256 hex digests (never the keys), its priority class,
    its share of the router's queue within the class, and its quotas (None: no limit)."""

    model_config = ConfigDict(extra="forbid")
    key_sha256: list[Sha256] = Field(min_length=1)
    priority_class: str = "default"
    weight: float = Field(default=1.0, gt=0)
    requests_per_second: float | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, ge=1)  # prompt tokens, the router's estimate
    concurrent_requests: int | None = Field(default=None, ge=1)


def check_tenants(tenants: dict[str, TenantConfig], admission: AdmissionConfig) -> None:
    """ValueError for a tenant of an unknown priority class, or a key named by two tenants."""
    seen: dict[str, str] = {}
    for name, tenant in tenants.items():
        if tenant.priority_class not in admission.classes:
            raise ValueError(f"tenant {name}: priority_class {tenant.priority_class!r} is not in admission.classes")
        for digest in tenant.key_sha256:
            if seen.setdefault(digest, name) != name:
                raise ValueError(f"tenants {seen[digest]} and {name} share a key")


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # Where workers are discovered; None uses only the static lists below.
    bootstrap_url: str | None = "http://127.0.0.1:8998"
    # Token of the bootstrap service (reads need none today; sent for forward compatibility).
    bootstrap_token: str | None = None
    prefill: list[StaticWorker] = []
    decode: list[StaticWorker] = []
    prefill_policy: PolicyName = "round_robin"
    decode_policy: PolicyName = "round_robin"
    # Clients must send `Authorization: Bearer <api_key>` when set (or env PDCLUSTER_API_KEY).
    api_key: str | None = None
    # Parsing a JSON body holds the event loop ~10-30 ms per MiB (orjson; more on a busy machine): the bound keeps
    # one request from stalling the others in this process for long.
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    connect_timeout: float = Field(default=5.0, gt=0)
    # Longest wait for the decode's response to start (headers; for a stream, before any token).
    first_byte_timeout: float = Field(default=300.0, gt=0)
    # Longest wait for a stream's first event once its answer has started (SGLang starts a stream before the first
    # token is computed, so first_byte_timeout alone would not bound it).
    first_token_timeout: float = Field(default=300.0, gt=0)
    # Longest wait for the next byte from a worker (a streamed token, or a whole non-streamed answer).
    read_timeout: float = Field(default=600.0, gt=0)
    # Longest a whole request may take, streamed or not.
    total_timeout: float = Field(default=1800.0, gt=0)
    # Attempts per request on new pairs, for connection errors and 5xx/429 before the first byte reaches the client.
    max_attempts: int = Field(default=3, ge=1, le=10)
    retry_backoff: float = Field(default=0.05, ge=0)  # doubled per attempt, with jitter
    # The most choices (`n`) an OpenAI request may ask for: each is a PD request of its own (router/openai/fanout.py).
    # At most the inventory's ceiling (router/checks/inventory/rules.py's MAX_N).
    max_n: int = Field(default=8, ge=1, le=64)
    # Consecutive failures that open a worker's circuit breaker, and how long it then gets no traffic.
    breaker_threshold: int = Field(default=5, ge=1)
    breaker_cooldown: float = Field(default=10.0, gt=0)
    health_interval: float = Field(default=1.0, gt=0)
    # An idle worker (no request of this router in flight, in rotation) is probed this seldom: SGLang answers each
    # /health with a one-token generation. A hung one is still seen by liveness within liveness_timeout.
    idle_health_interval: float = Field(default=15.0, gt=0)
    # SGLang's /health runs a one-token generation (>= 1 s, longer under load) and gives up itself after 20 s.
    health_timeout: float = Field(default=25.0, gt=0)
    # Consecutive failed health checks before a worker is ejected; one success readmits it.
    unhealthy_threshold: int = Field(default=2, ge=1)
    # Liveness, apart from /health (router/fleet/liveness.py; thresholds measured in docs/faults.md): every
    # liveness_interval each worker's /v1/loads is asked (SGLang's HTTP process answers it from shared memory).
    # No answer for liveness_timeout seconds, or a scheduler whose load snapshot has not moved for stall_timeout
    # seconds while it has work: the worker is hung, ejected, and the requests open on it are ended (retried on
    # another pair before their first byte, else an SSE error event). One live answer readmits it.
    liveness_interval: float = Field(default=1.0, gt=0)
    liveness_timeout: float = Field(default=5.0, gt=0)
    stall_timeout: float = Field(default=6.0, gt=0)
    # On SIGTERM the router takes no new connection and lets the requests it has (streams too) finish for this long
    # less 5 s, then closes them. Unset: PDCLUSTER_GRACE_SECONDS from the environment (compose and the chart set it
    # from the same value as Docker's and Kubernetes' grace periods), else 60.
    grace_period: float | None = Field(default=None, ge=10, le=3600)
    # Idle client connections are kept this long. Longer than what clients and load balancers keep one idle
    # (httpx and the openai client: 5 s; AWS ALB: 60 s), so that the client closes first: a server closing at the
    # moment a client reuses the connection fails that request ("Server disconnected without sending a response").
    keep_alive_timeout: int = Field(default=75, ge=1, le=3600)
    # Router processes sharing the port (SO_REUSEPORT), one core each at most: see router/processes.py.
    workers: int = Field(default=1, ge=1, le=64)
    # Each new worker instance (a new or restarted worker) gets traffic only once one short greedy canary through a
    # pair with it answers what admitted workers of its model answer (router/pd/admission.py).
    admission_check: bool = True
    # Answers name the pair that served them (X-Pdcluster-Prefill/-Decode) only when this is on: worker ids are
    # internal names of the cluster.
    expose_worker_ids: bool = False
    # OpenTelemetry spans per request, attempt and leg (router/tracing/spans.py); unset: env PDCLUSTER_TRACING. Where
    # they go: the OTEL_* variables (pdcluster/common/otel.py).
    tracing: bool | None = None
    # Stored responses and conversations (`store: true`, `previous_response_id`, the Conversations API).
    store: StoreConfig = Field(default_factory=StoreConfig)
    # Admission by predicted prefill wait: a bounded queue, then a 429 with Retry-After.
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    # Tenants by name; and/or a YAML file of more (a mounted Kubernetes Secret). With tenants, each API key names
    # its tenant, and api_key (or PDCLUSTER_API_KEY) is not used.
    tenants: dict[str, TenantConfig] = {}
    tenants_file: str | None = None
    log_level: str = "warning"
    # json: one JSON object per line (for log pipelines); text: human-readable lines.
    log_format: Literal["json", "text"] = "json"

    @model_validator(mode="after")
    def _static_prefills_have_bootstrap(self) -> RouterConfig:
        for worker in self.prefill:
            if worker.kv_bootstrap_port is None:
                raise ValueError(f"prefill {worker.url}: kv_bootstrap_port is required for a static prefill")
        return self

    @model_validator(mode="after")
    def _tenants_name_known_classes(self) -> RouterConfig:
        if self.api_key and (self.tenants or self.tenants_file):
            raise ValueError("api_key and tenants: the shared key is the single-tenant case; give each tenant keys")
        check_tenants(self.tenants, self.admission)
        return self

    def resolved_grace_period(self) -> float:
        return self.grace_period or float(os.environ.get("PDCLUSTER_GRACE_SECONDS") or 60)

    def resolved_api_key(self) -> str | None:
        return secret_or_env(self.api_key, "PDCLUSTER_API_KEY")
