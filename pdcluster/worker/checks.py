"""Checks both roles run before SGLang's long start-up, so a mistake costs a second, not a minute. (A role's own checks
are in prefill/plan.py and decode/plan.py.)"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from pdcluster.common.config_file import ConfigError
from pdcluster.common.protocol import BOOTSTRAP_SERVICE_PORT, WorkerCapabilities
from pdcluster.kvstore import wiring
from pdcluster.worker.options import SGLangOptions
from pdcluster.worker.settings import ClusterSettings

# Hugging Face hub ids look like "org/name"; anything else is taken as a local path.
_HUB_ID_PARTS = 2


def check_model_path(model_path: str | None) -> None:
    if not model_path:
        raise ConfigError("model-path is not set (set model-path in the config or pass --model-path)")
    path = Path(model_path).expanduser()
    looks_local = (
        path.is_absolute()
        or model_path.startswith((".", "~"))
        or len(path.parts) != _HUB_ID_PARTS
        or Path(path.parts[0]).exists()
    )
    if looks_local:
        if not path.is_dir():
            raise ConfigError(f"model-path {model_path} does not exist (build the demo model with 'make model')")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model-path {model_path} has no config.json: not a Hugging Face model folder")
    elif os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(f"model-path {model_path} is neither a local folder nor reachable (HF_HUB_OFFLINE=1)")


def check_port_free(host: str, port: int, what: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{what} port {port} on {host} is already in use") from None
            raise ConfigError(f"cannot listen on {host}:{port} for the {what}: {exc.strerror}") from None


def port_is_free(host: str, port: int) -> bool:
    try:
        check_port_free(host, port, "probe")
    except ConfigError:
        return False
    return True


def advertise_address(host: str, configured: str | None) -> str:
    """The address other processes reach this worker at (what it registers)."""
    if configured:
        return configured
    if host not in ("0.0.0.0", "::", ""):
        return host
    # In a container this is the address the service name resolves to, which is what peers can reach.
    return socket.gethostbyname(socket.gethostname())


# Host layouts the CPU adaptation of HiCache moves (page_first becomes page_first_direct with the direct io backend).
CPU_HICACHE_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def check_kv_store_dir(path: str) -> None:
    """The kv_store directory exists or can be created, and a file can be written in it."""
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".pdcluster-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"kv_store.dir {path}: cannot create or write it ({exc.strerror or exc})") from None


def check_kv_store(ns: argparse.Namespace, cpu: bool, role_check: Callable[[argparse.Namespace], None]) -> None:
    """SGLang options that would defeat the KV store (or crash it on CPU), refused before SGLang starts; `role_check`:
    the role's own (prefill/plan.py, decode/plan.py)."""
    if not wiring.is_sealed(ns.hicache_storage_backend, ns.hicache_storage_backend_extra_config):
        raise ConfigError(f"hicache-storage-backend {ns.hicache_storage_backend}: kv_store keeps KV in pdcluster's "
                          f"sealed file storage (remove one of the two)")
    role_check(ns)
    if cpu and ns.hicache_io_backend != "direct":
        raise ConfigError(f"hicache-io-backend {ns.hicache_io_backend} needs CUDA kernels: on CPU use direct")
    if cpu and ns.hicache_mem_layout not in CPU_HICACHE_LAYOUTS:
        raise ConfigError(f"hicache-mem-layout {ns.hicache_mem_layout} has no CPU transfer: on CPU use "
                          f"page_first_direct or layer_first")


def check_cpus(cluster: ClusterSettings) -> list[int]:
    """cluster.cpus as core numbers, every one of them a core this process may run on (a container or a cgroup
    may allow fewer than the host has), with taskset there to pin SGLang to them. Empty when unset."""
    cores = cluster.cpu_list()
    if not cores:
        return []
    allowed = os.sched_getaffinity(0)
    if missing := [c for c in cores if c not in allowed]:
        raise ConfigError(f"cluster.cpus {cluster.cpus}: core(s) {', '.join(map(str, missing))} not available here "
                          f"(this process may use {', '.join(map(str, sorted(allowed)))})")
    if shutil.which("taskset") is None:
        raise ConfigError("cluster.cpus needs taskset (util-linux) on the PATH")
    return cores


def capabilities(ns: argparse.Namespace, cpu: bool) -> WorkerCapabilities:
    """What the worker registers that requests may depend on (pdcluster/common/protocol.py), from SGLang's final
    options; ConfigError for what SGLang would only decide, or refuse, once it runs."""
    for option in ("tool_call_parser", "reasoning_parser"):
        if getattr(ns, option) == "auto":
            raise ConfigError(f"{option.replace('_', '-')} auto: name the parser (SGLang resolves auto only once it "
                              f"runs, and the router must know what both workers of a pair parse)")
    deterministic = bool(ns.enable_deterministic_inference or ns.rl_on_policy_target is not None)
    if deterministic and cpu:
        raise ConfigError(f"enable-deterministic-inference: SGLang refuses it with the {ns.attention_backend} "
                          f"attention backend of the CPU profile (it needs fa3, fa4, flashinfer, triton, ascend or "
                          f"intel_xpu, none of which runs on a CPU)")
    priority = bool(getattr(ns, "enable_priority_scheduling", False)) and \
        not getattr(ns, "schedule_low_priority_values_first", False)
    return WorkerCapabilities(tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                              deterministic_inference=deterministic, priority_scheduling=priority)


def kv_bootstrap_port(options: SGLangOptions, ns: argparse.Namespace, cluster: ClusterSettings) -> int:
    """The port of the worker's SGLang KV bootstrap server (a prefill's; a switch-enabled decode's): the configured
    one, checked, or else the first free one from `cluster.kv_bootstrap_port_base` up, set in `options`. Never the
    bootstrap service's port (8998)."""
    if options.is_set("disaggregation_bootstrap_port"):
        port = ns.disaggregation_bootstrap_port
        if port in (BOOTSTRAP_SERVICE_PORT, ns.port):
            raise ConfigError(f"disaggregation-bootstrap-port {port} collides with the "
                              f"{'bootstrap service' if port == BOOTSTRAP_SERVICE_PORT else 'HTTP port'}")
        check_port_free(ns.host, port, "SGLang KV bootstrap")
        return port
    base = cluster.kv_bootstrap_port_base
    for port in range(base, base + 200):
        if port not in (BOOTSTRAP_SERVICE_PORT, ns.port) and port_is_free(ns.host, port):
            options.set_value("disaggregation-bootstrap-port", port)
            return port
    raise ConfigError(f"no free port for the SGLang KV bootstrap server in {base}-{base + 199}")
