"""Tracing and scraping in the chart: `tracing.*` reaches every component as PDCLUSTER_TRACING and the OTEL_*
variables (each names itself: the router and the launchers default service.name to their role), and Prometheus finds
the router and the workers that serve SGLang's metrics."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.unit.helm.chart import container, env_of, render, workloads

REPO = Path(__file__).resolve().parents[3]

COMPONENTS = ("router", "prefill", "decode")


def test_tracing_is_off_by_default_and_says_so(rendered):
    for component in COMPONENTS:
        env = env_of(container(workloads(rendered["default"])[component]))
        assert env["PDCLUSTER_TRACING"]["value"] == "0", component
        assert not {name for name in env if name.startswith("OTEL_")}, component


def test_tracing_on_reaches_every_component_with_where_spans_go(chart):
    docs = render(chart, {"tracing": {"enabled": True, "endpoint": "http://otel:4318"}})
    for component in COMPONENTS:
        env = env_of(container(workloads(docs)[component]))
        assert env["PDCLUSTER_TRACING"]["value"] == "1", component
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4318", component
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "http/protobuf", component
        assert "OTEL_SERVICE_NAME" not in env, component  # one name for all would hide which role a span is from
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio", component
        assert float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == 1.0, component  # every request, as the SDK's default


def test_tracing_samples_a_share_of_requests_everywhere_alike(chart):
    """The router decides; the workers' SGLang follows the decision its `traceparent` carries."""
    docs = render(chart, {"tracing": {"enabled": True, "sampleRatio": 0.01}})
    for component in COMPONENTS:
        assert env_of(container(workloads(docs)[component]))["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.01", component


def test_prometheus_scrapes_the_router_and_workers_with_metrics(rendered):
    for component in COMPONENTS:
        annotations = workloads(rendered["default"])[component]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", component
        assert annotations["prometheus.io/path"] == "/metrics", component
    monitors = [d for d in rendered["servicemonitor"] if d["kind"] == "ServiceMonitor"]
    assert sorted(m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors) == sorted(COMPONENTS)


def test_the_worker_monitors_keep_sglangs_metric_names_as_the_deployed_scrape_config_does(rendered):
    """A Prometheus 2 gets SGLang's sglang:* series as sglang_* (OpenMetrics from its prometheus_client): the
    ServiceMonitors rename them back, as deploy/prometheus/prometheus.yml does, so one dashboard fits both."""
    deployed = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    rule = next(job for job in deployed if job["job_name"] == "decode")["metric_relabel_configs"][0]
    for monitor in (d for d in rendered["servicemonitor"] if d["kind"] == "ServiceMonitor"):
        component = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
        relabelings = monitor["spec"]["endpoints"][0].get("metricRelabelings", [])
        if component == "router":
            assert relabelings == []
        else:
            assert relabelings == [{"sourceLabels": rule["source_labels"], "regex": rule["regex"],
                                    "targetLabel": rule["target_label"], "replacement": rule["replacement"]}]
