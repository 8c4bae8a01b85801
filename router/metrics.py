"""The router's Prometheus metrics. One registry per app, so several routers in one process (tests) don't mix."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.workers import WorkerPool

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _PoolCollector(Collector):
    """Per-worker gauges read from the pool at scrape time: nothing to keep in sync on the hot path."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker", "role"]
        in_flight = GaugeMetricFamily("pdcluster_router_worker_in_flight", "Requests in flight per worker", labels=labels)
        healthy = GaugeMetricFamily("pdcluster_router_worker_healthy", "1 if the worker gets traffic", labels=labels)
        breaker = GaugeMetricFamily("pdcluster_router_breaker_state", "0 closed, 1 half-open, 2 open", labels=labels)
        for w in list(self.pool.workers.values()):
            key = [w.url, w.role.value]
            in_flight.add_metric(key, w.in_flight)
            healthy.add_metric(key, 1 if w.healthy else 0)
            breaker.add_metric(key, int(w.breaker.state))
        yield from (in_flight, healthy, breaker)


class RouterMetrics:
    def __init__(self, pool: WorkerPool):
        self.registry = CollectorRegistry()
        self.requests = Counter("pdcluster_router_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=self.registry)
        self.stream_errors = Counter("pdcluster_router_stream_errors", "Streams ended by an error event",
                                     ["route"], registry=self.registry)
        self.ttft = Histogram("pdcluster_router_ttft_seconds", "Time to the first streamed chunk", ["route"],
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("pdcluster_router_request_duration_seconds", "End-to-end request latency",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.retries = Counter("pdcluster_router_retries", "Requests retried on a new pair", ["route"],
                               registry=self.registry)
        self.aborts = Counter("pdcluster_router_aborts_sent", "/abort_request calls sent to workers", ["role"],
                              registry=self.registry)
        self.ejections = Counter("pdcluster_router_worker_ejections", "Workers taken out of rotation", ["role"],
                                 registry=self.registry)
        self.registry.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)
