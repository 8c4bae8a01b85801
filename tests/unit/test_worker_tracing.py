"""cluster.tracing: the SGLang command and environment it makes, and the tracing configs SGLang cannot honour,
refused before it starts."""

from __future__ import annotations

import pytest

from pdcluster.common.protocol import Role
from pdcluster.worker import tracing
from pdcluster.worker.options import ConfigError
from pdcluster.worker.plan import build_plan
from tests.unit.test_worker_plan import RULES, argv_value, model_dir, write_config

__all__ = ["model_dir"]  # the fixture, used by name


def traced(tmp_path, model_dir, env, setting="true", role=Role.PREFILL, yaml_text=""):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\n{yaml_text}\ncluster:\n  device: cpu\n"
                                    f"  tracing: {setting}\n")
    return build_plan(RULES[role], config, [], env={"PATH": "/usr/bin", **env})


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_tracing_starts_sglang_with_its_own_and_names_the_role(tmp_path, model_dir, role):
    p = traced(tmp_path, model_dir, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, role=role)
    assert "--enable-trace" in p.command
    assert argv_value(p.command, "--otlp-traces-endpoint") == "http://collector:4318/v1/traces"
    assert argv_value(p.command, "--otlp-service-name") == role.value
    assert argv_value(p.command, "--trace-modules") == "request,mooncake"
    assert p.env_added[tracing.PROTOCOL_ENV] == "http/protobuf"  # SGLang's default would be grpc


def test_grpc_the_switch_and_the_service_name(tmp_path, model_dir):
    env = {"PDCLUSTER_TRACING": "1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "prefill-a"}
    p = traced(tmp_path, model_dir, env, setting="null")
    assert argv_value(p.command, "--otlp-traces-endpoint") == "http://localhost:4317"
    assert argv_value(p.command, "--otlp-service-name") == "prefill-a"
    assert p.env[tracing.PROTOCOL_ENV] == "grpc"


def test_a_configured_option_wins_and_off_adds_nothing(tmp_path, model_dir):
    p = traced(tmp_path, model_dir, {}, yaml_text="otlp-traces-endpoint: c:4317\n")
    assert argv_value(p.command, "--otlp-traces-endpoint") == "c:4317"
    off = traced(tmp_path, model_dir, {"PDCLUSTER_TRACING": "1"}, setting="false")
    assert "--enable-trace" not in off.command and tracing.PROTOCOL_ENV not in off.env_added
    assert "--enable-trace" not in traced(tmp_path, model_dir, {"OTEL_TRACES_EXPORTER": "none"}).command


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "http/json"),
    ({"OTEL_TRACES_EXPORTER": "console"}, "OTLP only"),
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "jaeger"),
])
def test_what_sglang_cannot_honour_is_refused(tmp_path, model_dir, env, message):
    with pytest.raises(ConfigError, match=message):
        traced(tmp_path, model_dir, env)


def test_a_missing_exporter_is_refused(tmp_path, model_dir, monkeypatch):
    real = tracing.importlib.util.find_spec
    monkeypatch.setattr(tracing.importlib.util, "find_spec",
                        lambda name: None if name.endswith(".grpc") else real(name))
    with pytest.raises(ConfigError, match=r"opentelemetry\.exporter\.otlp\.proto\.grpc installed"):
        traced(tmp_path, model_dir, {})
