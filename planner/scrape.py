"""What the live planner reads of the router: its Prometheus /metrics text (router/metrics.py), parsed with
prometheus_client's own parser into one Scrape, and two scrapes' difference into one interval's Observation (the
sizing core's input, planner/sizing.py).

Counters and histograms are cumulative: an interval is the difference between two scrapes (a counter that went
down is a restarted router, whose new count is the interval's). SLO attainment comes from the histograms: the
requests within a bound are the bucket counts at or below it, linearly interpolated inside the bucket that holds it
(what Prometheus' histogram_quantile assumes too). Request rate: answers with a 2xx status; mean lengths: the usage
the router read from answers (pdcluster_router_usage_*), kept from the last interval that had some.
"""

from __future__ import annotations

import math
from collections import defaultdict
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


def _delta(now: float, before: float) -> float:
    return now if now < before else now - before  # went down: the router restarted and counts from zero


def _bucket_delta(now: Buckets, before: Buckets) -> Buckets:
    if any(now.get(le, 0.0) < count for le, count in before.items()):  # a restarted router: all of now is new
        return dict(now)
    return {le: count - before.get(le, 0.0) for le, count in now.items()}


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
    """Turns successive scrapes into intervals' Observations; remembers the last mean lengths seen, so that an
    interval whose answers carried no usage keeps the last known lengths instead of zeros."""

    ttft_bound_s: float
    itl_bound_s: float
    last: Scrape | None = None
    prompt_tokens: float = 0.0
    answer_tokens: float = 0.0

    def observe(self, scrape: Scrape, interval_s: float) -> Observation | None:
        """The interval since the previous scrape (None for the first one: nothing to difference it with)."""
        before, self.last = self.last, scrape
        if before is None:
            return None
        answers = _delta(scrape.usage_answers, before.usage_answers)
        if answers > 0:
            self.prompt_tokens = _delta(scrape.prompt_tokens, before.prompt_tokens) / answers
            self.answer_tokens = _delta(scrape.completion_tokens, before.completion_tokens) / answers
        arrivals = _delta(scrape.answered_ok, before.answered_ok)
        ttft_met, ttft_judged = within(_bucket_delta(scrape.ttft, before.ttft), self.ttft_bound_s)
        itl_met, itl_judged = within(_bucket_delta(scrape.itl, before.itl), self.itl_bound_s)
        load = Load(arrivals / interval_s if interval_s > 0 else 0.0, self.prompt_tokens, self.answer_tokens)
        return Observation(load, ttft_met=ttft_met, ttft_judged=ttft_judged, itl_met=itl_met, itl_judged=itl_judged)
