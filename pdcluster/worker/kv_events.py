"""SGLang's KV events for a worker: the `--kv-events-config` it runs with and the endpoint it registers.

SGLang 0.5.23 (`srt/disaggregation/kv_events.py`) publishes, from a worker with a radix cache, a ZMQ PUB message per
batch of cache events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and, on `replay_endpoint`, a ROUTER socket
that resends buffered batches from a given sequence number. A router subscribes to what the worker registers
(router/kv_routing/kv_events.py). The launcher picks the ports, like the KV bootstrap port: the first free pair from
`cluster.kv_events_port_base` up. It sets `bind: true`: SGLang would *connect* to a concrete host such as 127.0.0.1
(its heuristic binds only wildcards), and the worker listens on its --host like its other sockets.
"""

from __future__ import annotations

import argparse
import json

from pdcluster.common.config_file import ConfigError
from pdcluster.common.protocol import BOOTSTRAP_SERVICE_PORT, KVEventsEndpoint
from pdcluster.worker import checks
from pdcluster.worker.options import SGLangOptions
from pdcluster.worker.settings import ClusterSettings

SCAN = 200  # ports tried from the base
WILDCARDS = ("0.0.0.0", "::", "")


def plan_kv_events(options: SGLangOptions, ns: argparse.Namespace, cluster: ClusterSettings, advertise: str,
                   publishes: bool, taken: tuple[int | None, ...] = ()) -> KVEventsEndpoint | None:
    """The endpoint to register, setting `kv-events-config` in `options` when no source did. `publishes`: the role
    runs a radix cache (a prefill). `taken`: ports this worker uses already (HTTP, KV bootstrap)."""
    if options.is_set("kv_events_config"):
        return configured_endpoint(ns.kv_events_config, advertise)
    if not publishes or cluster.kv_events_port_base is None:
        return None
    port = _free_pair(ns.host, cluster.kv_events_port_base, {BOOTSTRAP_SERVICE_PORT, *filter(None, taken)})
    host = "*" if ns.host in WILDCARDS else (f"[{ns.host}]" if ":" in ns.host else ns.host)
    options.set_value("kv-events-config", {"publisher": "zmq", "endpoint": f"tcp://{host}:{port}",
                                           "replay_endpoint": f"tcp://{host}:{port + 1}", "bind": True})
    return KVEventsEndpoint(host=advertise, port=port, replay_port=port + 1)


def configured_endpoint(config: str | None, advertise: str) -> KVEventsEndpoint | None:
    """What an operator's own --kv-events-config publishes on, as others reach it (its port at the advertised
    address); None when it publishes nothing a router can subscribe to (no zmq publisher, not tcp)."""
    try:
        parsed = json.loads(config or "null")
    except ValueError as exc:
        raise ConfigError(f"kv-events-config is not JSON: {exc}") from None
    if not isinstance(parsed, dict) or parsed.get("publisher") != "zmq":
        return None
    port = _tcp_port(parsed.get("endpoint", "tcp://*:5557"))  # SGLang's default endpoint
    if port is None:
        return None
    topic = parsed.get("topic", "")
    return KVEventsEndpoint(host=advertise, port=port, replay_port=_tcp_port(parsed.get("replay_endpoint")),
                            topic=topic if isinstance(topic, str) else "")


def _tcp_port(endpoint: object) -> int | None:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() and 0 < int(port) < 65536 else None


def _free_pair(host: str, base: int, taken: set[int]) -> int:
    for port in range(base, base + SCAN):
        if not {port, port + 1} & taken and checks.port_is_free(host, port) and checks.port_is_free(host, port + 1):
            return port
    raise ConfigError(f"no two free ports for SGLang's KV events in {base}-{base + SCAN}")
