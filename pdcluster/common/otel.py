"""Tracing's switch and where spans go, read from the standard OpenTelemetry variables, for the router
(router/tracing/spans.py) and the worker launcher (pdcluster/worker/tracing.py) alike, so that one set of variables
(compose, the chart, a shell) sends every component's spans to the same collector.

Each component turns tracing on with its own `tracing` setting; unset, PDCLUSTER_TRACING decides (so compose and the
chart switch every component with one value). Read here, besides: OTEL_TRACES_EXPORTER (otlp, console, none),
OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL (http/protobuf, the specification's default, or grpc),
OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, and OTEL_SERVICE_NAME (default: the component's role). Imports no OpenTelemetry
package: deciding costs nothing when tracing is off.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping

SWITCH = "PDCLUSTER_TRACING"
PROTOCOLS = ("http/protobuf", "grpc")
EXPORTERS = ("otlp", "console", "none")
# The specification's defaults: OTLP/HTTP on 4318 (the path is the signal's), OTLP/gRPC on 4317.
DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}


def enabled(setting: bool | None, env: Mapping[str, str] | None = None) -> bool:
    """The component's own setting, else PDCLUSTER_TRACING; OTEL_TRACES_EXPORTER=none turns either off."""
    env = os.environ if env is None else env
    on = setting if setting is not None else env.get(SWITCH, "").strip().lower() in ("1", "true", "yes", "on")
    return on and exporter(env) != "none"


def exporter(env: Mapping[str, str]) -> str:
    """OTEL_TRACES_EXPORTER's first name (the variable may list several; one is enough to find a trace)."""
    return (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",")[0].strip().lower()


def protocol(env: Mapping[str, str]) -> str:
    return (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf").strip()


def traces_endpoint(env: Mapping[str, str], proto: str) -> str:
    """Where spans are sent, as the specification reads the variables: the traces endpoint as given; the general one
    with /v1/traces added for OTLP/HTTP (gRPC has no path); else the protocol's default."""
    if specific := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return specific
    base = (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_ENDPOINTS.get(proto, DEFAULT_ENDPOINTS["grpc"]))
    return base if proto == "grpc" else base.rstrip("/") + "/v1/traces"


def service_name(env: Mapping[str, str], role: str) -> str:
    return env.get("OTEL_SERVICE_NAME") or role


def check(env: Mapping[str, str]) -> str | None:
    """Why the variables cannot be honoured, or None."""
    if exporter(env) not in EXPORTERS:
        return f"OTEL_TRACES_EXPORTER={exporter(env)}: pdcluster exports with one of {', '.join(EXPORTERS)}"
    if protocol(env) not in PROTOCOLS:
        return f"OTLP protocol {protocol(env)!r}: one of {', '.join(PROTOCOLS)} (OTEL_EXPORTER_OTLP_PROTOCOL)"
    return None


def unsampled() -> dict[str, str]:
    """A `traceparent` of a fresh trace nobody samples, for the /health probes of a traced SGLang: each probe is a
    generation, which SGLang would trace as a trace of its own (whose root span never ends); under this parent, its
    sampler (parent-based: the SDK's default) records none of it."""
    return {"traceparent": f"00-{random.getrandbits(128) | 1:032x}-{random.getrandbits(64) | 1:016x}-00"}
