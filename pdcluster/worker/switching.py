"""Whether a worker starts switch-enabled (SGLang's --enable-pd-role-switch), what that adds to its launch, and what
it registers in either role.

A switch-enabled worker must be able to serve as both roles from the same process: SGLang runs a KV bootstrap server
on every such instance (each needs its own port on a host), the KV-events publisher is configured whichever role it
starts in (a decode's radix cache stores nothing in PD, so it publishes nothing until it becomes a prefill), and on
CPU it runs with both roles' CPU profiles. What it registers follows its current role: a prefill's KV bootstrap server
and KV events, a decode neither (the router uses them of prefills only).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.common.config_file import ConfigError
from pdcluster.common.protocol import KVEventsEndpoint, Role, WorkerRegistration
from pdcluster.worker.options import SGLangOptions
from pdcluster.worker.settings import ClusterSettings

SWITCHABLE_BACKENDS = frozenset({"mooncake", "mooncake_tcp"})  # their KV managers can be rebuilt in the other role
FLAG = "enable_pd_role_switch"
# Both roles' CPU profiles (prefill/plan.py and decode/plan.py CPU_FLAGS and CPU_ENV; tests/unit/test_role_flip.py
# checks the union): a flipped worker keeps the options it started with.
CPU_FLAGS = {"disable-overlap-schedule": True, "disaggregation-decode-retraction-backup": "cpu_tensor"}
CPU_ENV = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}
# Every switch-enabled worker: a prefill flipped to decode keeps its radix cache (a decode started as one runs none),
# and SGLang 0.5.23's idle check of the KV pool then counts one token short and, strict by default, kills the
# scheduler ("pool memory leak detected! total=65536, available=65441, evictable=94" after one request, measured on
# tiny-llama): it warns instead.
ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}
# A switch-enabled prefill: its radix cache, once it is a decode, keeps every finished request's KV, and SGLang's decode
# counts evictable cache entries as room for new requests only with this flag (disaggregation/decode.py's
# pre-allocation budget). Without it a flipped prefill's pool filled with cached turns under sustained load, its
# pre-allocations stopped, and every prefill's hand-off to it timed out after 60 s (tests/e2e_flip/test_planner.py).
# A worker started as decode is left as SGLang starts one (no radix cache: the flag would turn SGLang's experimental
# decode radix cache on).
PREFILL_FLAGS = {"disaggregation-decode-enable-radix-cache": True}


@dataclass
class FlipPlan:
    """What a switch-enabled worker registers as a prefill that it leaves out as a decode."""

    kv_bootstrap_host: str
    kv_bootstrap_port: int
    kv_events: KVEventsEndpoint | None


def decide(options: SGLangOptions, cluster: ClusterSettings, cpu: bool, role: Role) -> bool:
    """Whether the worker starts switch-enabled, setting the SGLang option (and, on CPU, the other role's profile)
    when it does. The config's own --enable-pd-role-switch decides first, then `cluster.role_switch`, then: wherever
    it can."""
    backend = options.tokens.get("disaggregation_transfer_backend", [None, "mooncake"])[1]
    if options.is_set(FLAG):
        enabled = options.tokens[FLAG] != []
    elif cluster.role_switch is None:
        enabled = backend in SWITCHABLE_BACKENDS and cluster.kv_store is None
    else:
        enabled = cluster.role_switch
    if enabled and backend not in SWITCHABLE_BACKENDS:
        raise ConfigError(f"role switching needs a Mooncake transfer backend, not {backend}: set cluster.role_switch "
                          f"false")
    if enabled and cluster.kv_store is not None:
        raise ConfigError("role switching with kv_store: SGLang clears its HiCache storage at a flip, which would "
                          "delete the shared store's pages; set cluster.role_switch false")
    if enabled:
        options.set_value("enable-pd-role-switch", True)
        for key, value in CPU_FLAGS.items() if cpu else ():
            options.set_default(key, value)
        for key, value in PREFILL_FLAGS.items() if role is Role.PREFILL else ():
            options.set_default(key, value)
    return enabled


def registration_as(role: Role, registration: WorkerRegistration, flip: FlipPlan) -> WorkerRegistration:
    """`registration` in `role`: what only a prefill registers set or cleared, and the KV pool's figures left to be
    read again (a decode's reserve differs)."""
    prefill = role is Role.PREFILL
    return registration.model_copy(update={
        "role": role, "kv_bootstrap_host": flip.kv_bootstrap_host if prefill else None,
        "kv_bootstrap_port": flip.kv_bootstrap_port if prefill else None,
        "kv_events": flip.kv_events if prefill else None, "kv_pool_tokens": None, "reserved_decode_tokens": None,
    })


def check_decode_port(options: SGLangOptions) -> None:
    """A decode's configured KV bootstrap port is for the server a switch-enabled decode runs: only with the switch
    set explicitly (else the launcher picks one when it turns switching on)."""
    if options.is_set("disaggregation_bootstrap_port") and options.tokens.get(FLAG, []) == []:
        raise ConfigError("disaggregation-bootstrap-port is a prefill option: a decode learns it per request (a "
                          "switch-enabled decode takes one with enable-pd-role-switch: true)")
