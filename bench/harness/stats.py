"""Percentiles of a benchmark's few samples, shared by the reports that give rounds' spreads (bench/tracing/cost.py,
bench/store/report.py)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """Linear between the closest ranks (few rounds: no sample is wasted)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    """p10, p50 and p90: the middle and the noise over rounds."""
    return {f"p{q}": round(percentile(values, q), digits) for q in (10, 50, 90)}
