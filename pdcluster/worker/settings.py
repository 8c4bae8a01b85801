"""The `cluster:` section of a worker config: this project's own settings, next to SGLang's options, and how it is
read (the file's section with the command line's --cluster overrides on top)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdcluster.common.config_file import ConfigError, secret_or_env, validation_message

DEFAULT_GRACE_SECONDS = 60.0


class KVStoreSettings(BaseModel):
    """KV cache on disk that survives restarts (SGLang HiCache with its `file` storage); `kv_store: DIR` is short for
    `kv_store: {dir: DIR}`. Files live in `<dir>/<fingerprint>/`, one namespace per model content and KV format, so
    one model's KV is never served to another; replicas with the same config share theirs."""

    model_config = ConfigDict(extra="forbid")

    # Base directory (relative: to the worker's working directory); created when missing, must be writable.
    dir: str = Field(default="kv-cache", min_length=1)
    # Disk bound of one namespace (SGLang's LRU evictor deletes the least recently used pages): "20GiB", "500MB" or
    # bytes; null: unbounded. Split evenly between the TP x PP ranks, each of which writes its own files.
    max_size: ByteSize | None = None
    # Free space SGLang keeps on the filesystem (it evicts, then skips writes below it): e.g. "5GiB"; null: none.
    min_free_space: ByteSize | None = None
    # Prefill: prompts matching fewer tokens than this beyond the device/host cache are not fetched from disk
    # (SGLang's default is 256; 64 lets the next turn of a conversation pick up what the decode wrote).
    prefetch_threshold: int = Field(default=64, ge=1)
    # Decode: write the KV of generated tokens too (multi-turn: the next turn's prompt starts with this answer).
    decode_offload: bool = True
    # Temporary files of a write cut short (".<uuid>.tmp") older than this many seconds are deleted at start; when
    # no other worker uses the namespace, all of them are.
    orphan_tmp_age: float = Field(default=600.0, ge=0)
    # A file holding the cluster secret (any bytes; surrounding whitespace ignored). With it, every page is sealed with
    # a MAC keyed by it, so a page written by anyone without it is never served. null: $PDCLUSTER_KV_SECRET if set,
    # else pages are sealed unkeyed (integrity only). Every worker sharing a namespace needs the same secret (the
    # bootstrap service refuses one whose secret differs: pdcluster/kvstore/secret_proof.py).
    secret_file: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _dir_shorthand(cls, value: object) -> object:
        return {"dir": value} if isinstance(value, str) else value


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Where the bootstrap service listens; None runs the worker unregistered (a router with a static list can use it).
    bootstrap_url: str | None = "http://127.0.0.1:8998"
    # Shared secret for the bootstrap service's writes; PDCLUSTER_TOKEN in the environment is used when unset.
    token: str | None = None
    # The address other processes reach this worker at. Default: SGLang's --host, or this host's name when that is
    # 0.0.0.0.
    advertise_host: str | None = None
    worker_id: str | None = None
    heartbeat_interval: float = Field(default=1.0, gt=0, le=60)
    # How often the launcher asks SGLang's /health once it serves (each is a one-token generation; the routers'
    # liveness watches every worker each second anyway). Until SGLang first answers, it asks every second.
    health_interval: float = Field(default=15.0, gt=0, le=600)
    # How long the worker has to stop once told to (SIGTERM): it deregisters at once, SGLang finishes
    # the requests it has for all of this but STOP_MARGIN, then is killed. Docker's stop_grace_period and Kubernetes'
    # terminationGracePeriodSeconds must be at least this (compose and the chart derive both from
    # PDCLUSTER_GRACE_SECONDS, which this defaults to when unset).
    grace_period: float | None = Field(default=None, ge=15, le=3600)

    def resolved_grace_period(self) -> float:
        return self.grace_period or float(os.environ.get("PDCLUSTER_GRACE_SECONDS") or DEFAULT_GRACE_SECONDS)
    # auto: CPU profile when torch sees no CUDA device.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # How long SGLang may take to answer /health before the launcher gives up on it.
    ready_timeout: float = Field(default=900.0, gt=0)
    # SGLang's OpenTelemetry spans (--enable-trace; pdcluster/worker/tracing.py), sent where the OTEL_* variables
    # say; unset: env PDCLUSTER_TRACING.
    tracing: bool | None = None
    # Extra environment for SGLang, e.g. its PD timeouts (SGLANG_DISAGGREGATION_*); the caller's environment wins.
    env: dict[str, str] = {}
    # SGLang's live role flip (`python -m bootstrap switch`; its --enable-pd-role-switch, which, when set in the
    # config, decides instead). A switch-enabled worker runs its own KV bootstrap server and KV-events publisher in
    # either role. null: on wherever it can: a Mooncake transfer backend and no kv_store (a flip clears SGLang's
    # HiCache storage: the shared store's files).
    role_switch: bool | None = None
    # First port tried for the SGLang KV bootstrap server (a prefill's; a switch-enabled decode's) when unset.
    kv_bootstrap_port_base: int = Field(default=8999, ge=1024, le=65000)
    # A prefill publishes SGLang's KV events (what its radix cache holds, for the routers' cache_aware policy) on the
    # first free pair of ports from here up (events, then replay), bound to SGLang's --host. null: it publishes none.
    kv_events_port_base: int | None = Field(default=5557, ge=1024, le=65000)
    # KV cache that survives restarts (prefill; decode with decode_offload); null: off. See KVStoreSettings.
    kv_store: KVStoreSettings | None = None
    # CPU profile only: extend attention that computes only the new tokens' queries (pdcluster/plugins/cpu_attention),
    # so a cache hit or a prefill chunk does not pay the cached tokens' attention again, and decode attention batched in
    # one call per layer. false: SGLang's own.
    cpu_attention: bool = True
    # The cores SGLang's whole process tree (scheduler, tokenizer, detokenizer, Mooncake's threads) may run on, as
    # taskset writes them: "0", "2-3", "0,2". Its torch/OpenMP threads are sized to them (OMP_NUM_THREADS), since
    # more threads than cores spin against each other at every parallel region. For several workers on one host
    # (each its own cores, e.g. a prefill and a decode); null: every core the launcher may use, SGLang's defaults.
    cpus: str | None = Field(default=None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$")

    def cpu_list(self) -> list[int]:
        """`cpus` as a sorted list of core numbers (empty when unset)."""
        cores: set[int] = set()
        for part in (self.cpus or "").split(","):
            if part:
                first, _, last = part.partition("-")
                cores.update(range(int(first), int(last or first) + 1))
        return sorted(cores)

    @field_validator("cpus")
    @classmethod
    def _ranges_ascend(cls, value: str | None) -> str | None:
        for part in (value or "").split(","):
            first, _, last = part.partition("-")
            if last and int(last) < int(first):
                raise ValueError(f"{part}: a range goes from the lower core to the higher")
        return value

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
        return secret_or_env(self.token, "PDCLUSTER_TOKEN")


def cluster_settings(section: object, overrides: dict[str, str | None] | None) -> ClusterSettings:
    """The file's cluster: section with the --cluster overrides on top, validated."""
    if isinstance(section, dict):
        section = _merge_overrides(section, overrides)
    try:
        return ClusterSettings.model_validate(section)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, section="cluster")) from None


def _merge_overrides(section: dict, overrides: dict[str, str | None] | None) -> dict:
    """`kv_store.max_size=10GiB` sets one key of a subsection."""
    merged = dict(section)
    for key, value in (overrides or {}).items():
        head, dot, rest = key.partition(".")
        if dot:
            sub = merged.get(head)
            merged[head] = {**({"dir": sub} if isinstance(sub, str) else sub or {}), rest: value}
        else:
            merged[key] = value
    return merged
