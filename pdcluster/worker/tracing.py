"""cluster.tracing: SGLang's own OpenTelemetry spans (`--enable-trace`), sent where the router's go (the OTEL_*
variables, read by pdcluster/common/otel.py), each worker's named after its role unless OTEL_SERVICE_NAME says
otherwise.

What SGLang 0.5.23 needs, read in its source (sglang/srt/observability/trace.py): the SDK and *both* OTLP exporters,
imported together (one missing, and --enable-trace fails at start); the protocol from
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL alone (grpc, its default, or http/protobuf), so the launcher sets it; and the
endpoint as given to --otlp-traces-endpoint, used as is (OTLP/HTTP wants the full .../v1/traces URL). It exports
OTLP only. What it cannot honour is refused here, before SGLang starts, rather than by a worker that fails later.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from pdcluster.common import otel
from pdcluster.common.config_file import ConfigError
from pdcluster.worker.options import SGLangOptions

NEEDED = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc", "opentelemetry.exporter.otlp.proto.http")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
# The request's stages and, for the hand-off, Mooncake's transfers (SGLang traces only `request` by default).
TRACE_MODULES = "request,mooncake"


def missing_packages() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is absent
            found = False
        if not found:
            missing.append(name)
    return missing


def apply(options: SGLangOptions, setting: bool | None, role: str, env: Mapping[str, str]) -> dict[str, str]:
    """With tracing on, SGLang's tracing options (where no source set them); returns the environment SGLang needs for
    them. Off: nothing."""
    if not otel.enabled(setting, env):
        return {}
    if (problem := otel.check(env)) is not None:
        raise ConfigError(f"cluster.tracing: {problem}")
    if otel.exporter(env) != "otlp":
        raise ConfigError(f"cluster.tracing: SGLang exports OTLP only, not OTEL_TRACES_EXPORTER={otel.exporter(env)}")
    if missing := missing_packages():
        raise ConfigError(f"cluster.tracing: SGLang's --enable-trace needs {', '.join(missing)} installed "
                          "(pdcluster's dependencies include them: reinstall it)")
    protocol = otel.protocol(env)
    options.set_default("enable-trace", True)
    options.set_default("trace-modules", TRACE_MODULES)
    options.set_default("otlp-traces-endpoint", otel.traces_endpoint(env, protocol))
    options.set_default("otlp-service-name", otel.service_name(env, role))
    return {PROTOCOL_ENV: protocol}
