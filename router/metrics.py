"""The router's Prometheus metrics. One registry per app, so several routers in one process (tests) don't mix.

With several router processes (router/processes.py sets PROMETHEUS_MULTIPROC_DIR), counters and histograms are
summed over the processes by prometheus_client, and the per-worker gauges are sampled into multiprocess gauges.

The cache report (`cached_tokens`): how much of each prompt the workers had cached, read from the decode's answer.
SGLang reports `meta_info.cached_tokens` on every native answer, and `cached_tokens_details` ({"device", "host",
"storage"}: which tier of HiCache held them) when any were cached; in PD mode the prefill's counts travel to the
decode, whose answer the router relays. OpenAI answers carry `usage.prompt_tokens_details.cached_tokens` when the
workers run with `enable-cache-report`. The answer is scanned, not parsed: a few microseconds per answer.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from router.fleet.workers import WorkerPool

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
# Predicted less actual cached tokens: signed, so that a stale index (over 0) and a lagging one (under 0) show apart.
MISS_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)


# The tenant of the request being served (router/admission/tenants.py), for the per-tenant metrics; None: no tenants.
CURRENT_TENANT: ContextVar[str | None] = ContextVar("tenant", default=None)

_GAUGES: list[tuple[str, str, Literal["livesum", "livemin", "livemax"]]] = [  # name, help, how processes combine
    ("pdcluster_router_worker_in_flight", "Requests in flight per worker", "livesum"),
    ("pdcluster_router_worker_healthy", "1 if the worker gets traffic", "livemin"),
    ("pdcluster_router_breaker_state", "0 closed, 1 half-open, 2 open", "livemax"),
    # The planner's input (planner/): a prefill's queued work, the prompt tokens it will still compute.
    ("pdcluster_router_worker_queued_tokens", "Prompt tokens booked on a worker's unanswered prefill halves that it "
     "will compute (not hold cached)", "livesum"),
]


def _pool_values(pool: WorkerPool) -> Iterator[tuple[list[str], tuple[int, int, int, int]]]:
    for w in list(pool.workers.values()):
        yield [w.url, w.role.value], (w.in_flight, 1 if w.healthy else 0, int(w.breaker.state), w.pending_work_tokens)


class _PoolCollector(Collector):
    """Per-worker gauges read from the pool at scrape time: nothing to keep in sync on the hot path."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = [GaugeMetricFamily(name, doc, labels=["worker", "role"]) for name, doc, _ in _GAUGES]
        for key, values in _pool_values(self.pool):
            for family, value in zip(families, values, strict=True):
                family.add_metric(key, value)
        yield from families


class _Labelled:
    """A labelled metric whose children are looked up once: prometheus_client's labels() takes a lock and checks
    the label values on every call, a few microseconds on each request's path."""

    def __init__(self, metric: Counter | Histogram):
        self.metric = metric
        self.children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self, pool: WorkerPool):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = _Labelled(Counter("pdcluster_router_requests", "Requests answered, by route and HTTP status",
                                          ["route", "status"], registry=r))
        self.stream_errors = _Labelled(Counter("pdcluster_router_stream_errors", "Streams ended by an error event",
                                               ["route"], registry=r))
        self.ttft = _Labelled(Histogram("pdcluster_router_ttft_seconds", "Time to the first streamed chunk",
                                        ["route"], buckets=LATENCY_BUCKETS, registry=r))
        self.itl = _Labelled(Histogram(
            "pdcluster_router_itl_seconds", "Per streamed answer, the mean time between its events after the first "
            "(SGLang sends one per stream_interval tokens, 1 by default: the inter-token latency a client sees)",
            ["route"], buckets=ITL_BUCKETS, registry=r))
        self.latency = _Labelled(Histogram("pdcluster_router_request_duration_seconds", "End-to-end request latency",
                                           ["route"], buckets=LATENCY_BUCKETS, registry=r))
        self.retries = _Labelled(Counter("pdcluster_router_retries", "Requests retried on a new pair", ["route"],
                                         registry=r))
        self.aborts = _Labelled(Counter("pdcluster_router_aborts_sent", "/abort_request calls sent to workers",
                                        ["role"], registry=r))
        self.cached_tokens = _Labelled(Counter(
            "pdcluster_router_cached_prompt_tokens", "Prompt tokens the workers had cached, by tier (total: all tiers;"
            " device, host, storage: HiCache's tiers, when SGLang reports them)", ["tier"], registry=r))
        self.ejections = _Labelled(Counter("pdcluster_router_worker_ejections", "Workers taken out of rotation",
                                           ["role"], registry=r))
        self.admissions = _Labelled(Counter(
            "pdcluster_router_admissions", "Admission canaries of new worker instances, by result (admitted, refused; "
            "error: the canary could not run and is tried again)", ["role", "result"], registry=r))
        self.spans_dropped = Counter(
            "pdcluster_router_spans_dropped", "Spans the router dropped (router/tracing/export.py): its exporter "
            "process was behind or gone, and the pipe to it full", registry=r)
        self.usage_tokens = _Labelled(Counter(
            "pdcluster_router_usage_tokens", "Tokens of the answers whose usage the router read (native answers, "
            "OpenAI ones with usage), by kind (prompt, completion): the planner's mean lengths", ["kind"], registry=r))
        self.usage_answers = Counter("pdcluster_router_usage_answers", "Answers (items of a batch) whose usage "
                                     "pdcluster_router_usage_tokens counted", registry=r)
        self._kv_metrics(r)
        self._admission_metrics(r)
        self._tenant_metrics(r)
        self.pool = pool
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if self.multiprocess:
            self._gauges = [Gauge(name, doc, ["worker", "role"], multiprocess_mode=mode, registry=self.registry)
                            for name, doc, mode in _GAUGES]
            self._sampled: set[tuple[str, ...]] = set()
        else:
            self.registry.register(_PoolCollector(pool))

    def _admission_metrics(self, r: CollectorRegistry) -> None:
        """Admission by predicted wait (router/admission/gate.py)."""
        self.refusals = _Labelled(Counter(
            "pdcluster_router_admission_refusals", "Requests refused with a 429 before any worker saw them, by class "
            "and reason (predicted_wait: over the bound, no queue; queue_full; queue_timeout)", ["class", "reason"],
            registry=r))
        self.queue_length = Gauge("pdcluster_router_admission_queue_length", "Requests in the router's admission "
                                  "queue, by class", ["class"], multiprocess_mode="livesum", registry=r)
        self.predicted_wait = Histogram(
            "pdcluster_router_admission_predicted_wait_seconds", "Per request, the prefill wait predicted at its "
            "arrival (the least of the usable prefills')", buckets=LATENCY_BUCKETS, registry=r)

    def _tenant_metrics(self, r: CollectorRegistry) -> None:
        """Per tenant (router/admission/tenants.py), when the router has tenants."""
        self.tenant_requests = _Labelled(Counter("pdcluster_router_tenant_requests", "Requests answered, by tenant "
                                                 "and HTTP status", ["tenant", "status"], registry=r))
        self.tenant_tokens = _Labelled(Counter("pdcluster_router_tenant_prompt_tokens", "Prompt tokens admitted (the "
                                               "router's estimate), by tenant", ["tenant"], registry=r))
        self.tenant_refusals = _Labelled(Counter(
            "pdcluster_router_tenant_refusals", "429s by tenant and reason (a quota: requests_per_second, "
            "tokens_per_minute, concurrent_requests; or admission's)", ["tenant", "reason"], registry=r))
        self.tenant_ttft = _Labelled(Histogram("pdcluster_router_tenant_ttft_seconds", "Time to the first streamed "
                                               "chunk, by tenant", ["tenant"], buckets=LATENCY_BUCKETS, registry=r))
        self.tenant_itl = _Labelled(Histogram("pdcluster_router_tenant_itl_seconds", "Per streamed answer, the mean "
                                              "time between its events, by tenant", ["tenant"], buckets=ITL_BUCKETS,
                                              registry=r))

    def first_token(self, route: str, seconds: float) -> None:
        self.ttft.labels(route).observe(seconds)
        if (tenant := CURRENT_TENANT.get()) is not None:
            self.tenant_ttft.labels(tenant).observe(seconds)

    def _kv_metrics(self, r: CollectorRegistry) -> None:
        """The cache_aware policy's (router/kv_routing/cache_aware.py, router/kv_routing/kv_events.py)."""
        self.kv_batches = _Labelled(Counter(
            "pdcluster_router_kv_event_batches", "KV event batches from prefills, by result (applied, duplicate: "
            "already replayed, malformed)", ["worker", "result"], registry=r))
        self.kv_gaps = _Labelled(Counter("pdcluster_router_kv_event_gaps", "Sequence gaps in a prefill's KV events",
                                         ["worker"], registry=r))
        self.kv_resyncs = _Labelled(Counter(
            "pdcluster_router_kv_index_resyncs", "A prefill's KV index replayed (replayed) or dropped, by reason",
            ["worker", "reason"], registry=r))
        self.kv_index_pages = Gauge("pdcluster_router_kv_index_pages", "Pages the router's KV index holds per prefill",
                                    ["worker"], multiprocess_mode="livemax", registry=r)
        self.routing = _Labelled(Counter(
            "pdcluster_router_routing_decisions", "cache_aware choices of a prefill, by kind (indexed; blind: no "
            "KV events heard from any candidate; no_tokens: no token ids for the prompt)", ["kind"], registry=r))
        self.kv_lag = _Labelled(Histogram(
            "pdcluster_router_kv_event_lag_seconds", "From a prefill's publishing a KV event batch to this router "
            "applying it (live batches; the two hosts' clock skew included)", ["worker"], buckets=LAG_BUCKETS,
            registry=r))
        self.prediction = _Labelled(Counter(
            "pdcluster_router_kv_prediction_tokens", "Answers of the requests the KV index routed: the prompt tokens "
            "their prefill was predicted to hold (predicted) and those the answer reports cached (actual)", ["kind"],
            registry=r))
        self.prediction_miss = Histogram(
            "pdcluster_router_kv_prediction_miss_tokens", "Per answer the KV index routed: predicted less actual "
            "cached tokens (over 0: the index claimed pages the prefill no longer held; under 0: it held more than "
            "the index knew)", buckets=MISS_BUCKETS, registry=r)
        self._kv_sized: set[str] = set()

    def set_kv_index_sizes(self, sizes: dict[str, int]) -> None:
        for worker_id, pages in sizes.items():
            self.kv_index_pages.labels(worker_id).set(pages)
        for gone in self._kv_sized - sizes.keys():
            self.kv_index_pages.remove(gone)
        self._kv_sized = set(sizes)

    def count_cached(self, answer: bytes, stream: bool = False, predicted: int | None = None) -> None:
        """`answer`: a whole answer, or (`stream`) a stream's last chunk with counts, whose last event is counted.
        `predicted`: the cached tokens the KV index predicted for it (router/kv_routing/cache_aware.py), if it
        routed it."""
        if stream:  # SGLang's counts in a stream are cumulative: only the last event's count
            events = [e for e in answer.split(b"\n\n") if b"cached_tokens" in e]
            answer = events[-1] if events else b""
        found = cached_tokens(answer)
        self._count_usage(answer)
        for tier, count in found.items():
            self.cached_tokens.labels(tier).inc(count)
        if predicted is not None and "total" in found:  # an OpenAI answer without SGLang's cache report: no count
            self.prediction.labels("predicted").inc(predicted)
            self.prediction.labels("actual").inc(found["total"])
            self.prediction_miss.observe(predicted - found["total"])

    def _count_usage(self, answer: bytes) -> None:
        completions = [int(n) for n in _COMPLETION.findall(answer)]
        if completions:
            self.usage_answers.inc(len(completions))
            self.usage_tokens.labels("completion").inc(sum(completions))
            self.usage_tokens.labels("prompt").inc(sum(int(n) for n in _PROMPT.findall(answer)))

    def stream_ended(self, route: str | None, first_at: float, events: int) -> None:
        """A delivered stream whose first event came at `first_at` (monotonic) and that sent `events` events, its
        closing `[DONE]` one of them: one observation per answer (not per event: the relay's path stays cheap).
        `route` None: a fan-out's choice, whose merged stream is timed by the fan-out."""
        if route is not None and events > 2:
            itl = (time.monotonic() - first_at) / (events - 2)
            self.itl.labels(route).observe(itl)
            if (tenant := CURRENT_TENANT.get()) is not None:
                self.tenant_itl.labels(tenant).observe(itl)

    def sample_pool(self) -> None:
        """Multiprocess mode: write this process's view of its workers where the other processes can read it."""
        seen: set[tuple[str, ...]] = set()
        for key, values in _pool_values(self.pool):
            seen.add(tuple(key))
            for gauge, value in zip(self._gauges, values, strict=True):
                gauge.labels(*key).set(value)
        for gone in self._sampled - seen:  # a worker that left the pool: not in flight, not healthy
            for gauge in self._gauges:
                gauge.labels(*gone).set(0)
        self._sampled = seen

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        self.sample_pool()
        summed = CollectorRegistry()
        MultiProcessCollector(summed)
        return generate_latest(summed)


_TOTAL = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_DETAILS = re.compile(rb'"cached_tokens_details"\s*:\s*\{([^}]*)\}')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TIER = re.compile(rb'"(device|host|storage)"\s*:\s*(\d+)')


def cached_tokens(answer: bytes) -> dict[str, int]:
    """{"total": n, "device": d, "host": h, "storage": s} summed over the items of the answer (a batch has several);
    tiers only where SGLang reported them. For a stream, pass its last event: SGLang's counts are cumulative."""
    found: dict[str, int] = {}
    for match in _TOTAL.finditer(answer):
        found["total"] = found.get("total", 0) + int(match.group(1))
    for details in _DETAILS.finditer(answer):
        for tier, count in _TIER.findall(details.group(1)):
            found[tier.decode()] = found.get(tier.decode(), 0) + int(count)
    return found
