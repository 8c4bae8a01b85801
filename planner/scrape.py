"""What the live planner reads of the router: its Prometheus /metrics text (router/metrics.py), parsed with
prometheus_client's own parser into one Scrape, and two scrapes' difference into one interval's Observation (the
sizing core's input, planner/sizing.py).

Counters and histograms are cumulative: an interval is the difference between two scrapes of each router (every
address the router URL's name resolves to: behind a headless Service or compose's --scale, several), summed over
them (a counter that went down is a restarted router, whose new count is the interval's). SLO attainment comes from
the histograms: the requests within a bound are the bucket counts at or below it, linearly interpolated inside the
bucket that holds it (what Prometheus' histogram_quantile assumes too). Request rate: answers with a 2xx status; mean
lengths: the usage the router read from answers (pdcluster_router_usage_*), kept from the last interval with some.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from planner.predict import Load
from planner.sizing import Observation

Buckets = dict[float, float]  # upper bound (le) -> cumulative count, summed over routes


@dataclass
class Scrape:
    """One read of the router's /metrics: the cumulative series the planner uses, summed over routes."""

    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    answered_ok: float = 0.0  # requests answered with a 2xx status
    usage_answers: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    # Per worker, gauges: requests in flight and queued prefill work by the worker's URL, KV index pages by its id.
    in_flight: dict[str, float] = field(default_factory=dict)
    queued_tokens: dict[str, float] = field(default_factory=dict)
    kv_pages: dict[str, float] = field(default_factory=dict)


def parse(text: str) -> Scrape:
    """The router's /metrics text as a Scrape (series it does not know are ignored)."""
    out = Scrape()
    buckets: dict[str, Buckets] = {"pdcluster_router_ttft_seconds": defaultdict(float),
                                   "pdcluster_router_itl_seconds": defaultdict(float)}
    per_worker = {"pdcluster_router_worker_in_flight": out.in_flight,
                  "pdcluster_router_worker_queued_tokens": out.queued_tokens,
                  "pdcluster_router_kv_index_pages": out.kv_pages}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name.endswith("_bucket") and name[:-len("_bucket")] in buckets:
                buckets[name[:-len("_bucket")]][float(labels["le"])] += value
            elif name == "pdcluster_router_requests_total" and labels.get("status", "").startswith("2"):
                out.answered_ok += value
            elif name == "pdcluster_router_usage_answers_total":
                out.usage_answers += value
            elif name == "pdcluster_router_usage_tokens_total":
                kind = labels.get("kind")
                if kind == "prompt":
                    out.prompt_tokens += value
                elif kind == "completion":
                    out.completion_tokens += value
            elif name in per_worker and "worker" in labels:
                per_worker[name][labels["worker"]] = value
    out.ttft, out.itl = dict(buckets["pdcluster_router_ttft_seconds"]), dict(buckets["pdcluster_router_itl_seconds"])
    return out


@dataclass
class Counts:
    """What one interval added to the cumulative series, over one or several routers."""

    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    answered_ok: float = 0.0
    usage_answers: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0

    def __add__(self, other: Counts) -> Counts:
        return Counts(_add(self.ttft, other.ttft), _add(self.itl, other.itl), self.answered_ok + other.answered_ok,
                      self.usage_answers + other.usage_answers, self.prompt_tokens + other.prompt_tokens,
                      self.completion_tokens + other.completion_tokens)


def _add(a: Buckets, b: Buckets) -> Buckets:
    return {le: a.get(le, 0.0) + b.get(le, 0.0) for le in a.keys() | b.keys()}


def counts_since(now: Scrape, before: Scrape) -> Counts:
    """One router's interval; a series that went down is a restarted router, whose counts are all the interval's."""
    restarted = now.answered_ok < before.answered_ok or now.usage_answers < before.usage_answers or any(
        now.ttft.get(le, 0.0) < count for le, count in before.ttft.items()) or any(
        now.itl.get(le, 0.0) < count for le, count in before.itl.items())
    if restarted:
        before = Scrape()
    return Counts({le: c - before.ttft.get(le, 0.0) for le, c in now.ttft.items()},
                  {le: c - before.itl.get(le, 0.0) for le, c in now.itl.items()},
                  now.answered_ok - before.answered_ok, now.usage_answers - before.usage_answers,
                  now.prompt_tokens - before.prompt_tokens, now.completion_tokens - before.completion_tokens)


def merged(scrapes: Iterable[Scrape]) -> Scrape:
    """Several routers' per-worker gauges as one: requests in flight and queued work add up; the KV index pages are
    each router's own index of the same prefill: the largest."""
    out = Scrape()
    for scrape in scrapes:
        for mine, theirs in ((out.in_flight, scrape.in_flight), (out.queued_tokens, scrape.queued_tokens)):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0.0) + value
        for key, value in scrape.kv_pages.items():
            out.kv_pages[key] = max(out.kv_pages.get(key, 0.0), value)
    return out


def within(buckets: Buckets, bound: float) -> tuple[int, int]:
    """(observations at or below `bound`, all observations) of cumulative `buckets`; inside a bucket, linear."""
    if not buckets:
        return 0, 0
    total = buckets.get(math.inf, max(buckets.values()))
    below_le, below = 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le]
        if le >= bound:
            if math.isinf(le):
                return round(below), round(total)
            share = (bound - below_le) / (le - below_le) if le > below_le else 1.0
            return round(below + (count - below) * share), round(total)
        below_le, below = le, count
    return round(below), round(total)


@dataclass
class Windower:
    """Turns successive scrapes of the routers (by address: each router's counters are its own) into intervals'
    Observations; remembers the last mean lengths seen, so that an interval whose answers carried no usage keeps the
    last known lengths instead of zeros."""

    ttft_bound_s: float
    itl_bound_s: float
    last: dict[str, Scrape] | None = None
    prompt_tokens: float = 0.0
    answer_tokens: float = 0.0

    def observe(self, scrapes: dict[str, Scrape], interval_s: float) -> Observation | None:
        """The interval since the previous scrapes (None for the first: nothing to difference them with). A router
        seen for the first time only sets its baseline; one gone takes its last interval with it."""
        before, self.last = self.last, dict(scrapes)
        if before is None:
            return None
        total = Counts()
        for source, scrape in scrapes.items():
            if source in before:
                total = total + counts_since(scrape, before[source])
        if total.usage_answers > 0:
            self.prompt_tokens = total.prompt_tokens / total.usage_answers
            self.answer_tokens = total.completion_tokens / total.usage_answers
        ttft_met, ttft_judged = within(total.ttft, self.ttft_bound_s)
        itl_met, itl_judged = within(total.itl, self.itl_bound_s)
        load = Load(total.answered_ok / interval_s if interval_s > 0 else 0.0, self.prompt_tokens, self.answer_tokens)
        return Observation(load, ttft_met=ttft_met, ttft_judged=ttft_judged, itl_met=itl_met, itl_judged=itl_judged)
