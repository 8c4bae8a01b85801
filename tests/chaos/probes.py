"""tests.chaos: the probes behind the router's liveness thresholds (docs/faults.md): /v1/loads four times a
second and SGLang's /health, per worker."""

from __future__ import annotations

import threading
import time

import httpx

from pdcluster.local.cluster import LocalCluster
from tests.chaos.load import Load
from tests.helpers import worker_url


class Probes:
    """Every worker's liveness endpoint (/v1/loads) asked 4 times a second, as the router does once a second: how
    long it takes to answer, and how long the scheduler's snapshot stays unchanged while it has work. In the
    steady phase also SGLang's /health (a real generation), for comparison."""

    def __init__(self, cluster: LocalCluster, load: Load):
        self.cluster, self.load = cluster, load
        self.names = [*(f"prefill-{i}" for i in range(cluster.spec.prefill.count)),
                      *(f"decode-{i}" for i in range(cluster.spec.decode.count))]
        self.samples: dict[str, list[tuple[float, float | None, bool | None, float | None, float]]] = {
            n: [] for n in self.names}
        self.health: dict[str, list[tuple[float, float | None]]] = {n: [] for n in self.names}  # (t, seconds)
        # as router/fleet/liveness.py keeps it
        self.waiting_since: dict[str, float | None] = {n: None for n in self.names}
        self.stop = threading.Event()
        self.heavy = threading.Event()
        self.excluded: dict[str, list[tuple[float, float]]] = {n: [] for n in self.names}  # fault windows
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in self.names]
        self.threads += [threading.Thread(target=self._heavy, args=(n,), daemon=True) for n in self.names]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _run(self, name: str) -> None:
        url = worker_url(self.cluster, name)
        last_stamps, last_change = None, None
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                t = self.load.now()
                began = time.monotonic()
                latency = busy = gap = None
                try:
                    response = client.get(f"{url}/v1/loads", params={"include": "core,disagg"})
                    latency = time.monotonic() - began
                    loads = response.json()["loads"]
                    stamps = tuple(load["timestamp"] for load in loads)
                    busy = any(load["num_running_reqs"] or load["num_waiting_reqs"] or any(
                        v for k, v in (load.get("disaggregation") or {}).items() if k.endswith("_reqs"))
                        for load in loads)
                    if stamps != last_stamps:
                        last_stamps, last_change = stamps, t
                    gap = t - last_change
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    last_stamps = None
                # The router's stall measure: /health waiting and the snapshot still, both for this long.
                waiting = self.waiting_since[name]
                stall = t - max(waiting, last_change) if waiting is not None and last_change is not None else 0.0
                self.samples[name].append((t, latency, busy, gap, stall))
                self.stop.wait(max(0.0, 0.25 - (time.monotonic() - began)))

    def _heavy(self, name: str) -> None:
        url = worker_url(self.cluster, name)
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                if not self.heavy.wait(0.5):
                    continue
                began, t = time.monotonic(), self.load.now()
                if self.waiting_since[name] is None:
                    self.waiting_since[name] = t
                try:
                    ok = client.get(f"{url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.waiting_since[name] = None
                self.health[name].append((t, time.monotonic() - began if ok else None))
                self.stop.wait(1.0)

    def exclude(self, name: str, start: float, end: float) -> None:
        self.excluded[name].append((start, end))

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict:
        def pct(values: list[float], q: float) -> float:
            values = sorted(values)
            return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1) if values else None

        out = {}
        for name in self.names:
            windows = self.excluded[name]

            def kept(t: float, windows: list[tuple[float, float]] = windows) -> bool:
                return since <= t <= until and not any(a - 1 <= t <= b + 5 for a, b in windows)

            keep = [s for s in self.samples[name] if kept(s[0])]
            latencies = [s[1] for s in keep if s[1] is not None]
            busy_gaps = [s[3] for s in keep if s[2] and s[3] is not None]
            stalls = [s[4] for s in keep]
            heavy = [h for t, h in self.health[name] if h is not None and kept(t)]
            out[name] = {
                "samples": len(keep),
                "unanswered": sum(1 for s in keep if s[1] is None),
                "loads_ms": {"p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99),
                             "max": round(max(latencies) * 1000, 1) if latencies else None},
                "busy_fraction": round(sum(1 for s in keep if s[2]) / len(keep), 3) if keep else None,
                "max_snapshot_gap_busy_s": round(max(busy_gaps), 2) if busy_gaps else None,
                "max_stall_measure_s": round(max(stalls), 2) if stalls else None,
                "health_ms": {"n": len(heavy), "p50": pct(heavy, 0.5), "p99": pct(heavy, 0.99),
                              "max": round(max(heavy) * 1000, 1) if heavy else None},
            }
        return out


