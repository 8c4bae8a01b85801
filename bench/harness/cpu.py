"""CPU of the processes under test and of the rest of the machine, from psutil: the idle-cluster measurement of
bench.cluster, the "how busy were the others" and "how fast was the machine" figures recorded with every benchmark
run, and the waits for a quiet machine before a run and for quiet processes between cells."""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections import Counter, defaultdict

import psutil

from bench.harness.procs import tree, tree_cpu_seconds

CONTENDED_CORES = 0.3  # a cell where processes outside the benchmark used more CPU than this is flagged


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0) + getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return sum(t) - idle  # guest time is counted in user time already


def busy_cores(seconds: float) -> float:
    """Cores the whole machine kept busy over the next `seconds` (what any other work on it shows as)."""
    before = busy_cpu_seconds()
    time.sleep(seconds)
    return (busy_cpu_seconds() - before) / seconds


def wait_for_quiet(max_wait: float) -> float:
    """Wait (up to max_wait s) until the machine is nearly idle; return the cores busy at the last look."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = busy_cores(2.0)
        if busy < CONTENDED_CORES or time.monotonic() >= deadline:
            return round(busy, 3)
        print(f"bench: the machine is busy ({busy:.2f} cores used by others); waiting for it to calm down",
              flush=True)


class Tree:
    """A process tree by its root PID, as `settle` watches it."""

    def __init__(self, pid: int):
        self.pid = pid

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)


def settle(watched: dict, max_wait: float = 10.0) -> float:
    """After a cell, wait until the processes under test (anything with `cpu_seconds()`: a procs.Proc, a Tree) are
    idle again (a router may still be working off requests the load generator gave up on), so that the next cell does
    not pay for this one. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait:
        before = sum(p.cpu_seconds() for p in watched.values())
        time.sleep(0.5)
        if sum(p.cpu_seconds() for p in watched.values()) - before < 0.05 * 0.5 * len(watched):
            break
    return round(time.monotonic() - started, 2)


def probe_ms(rounds: int = 3) -> float:
    """How long a fixed piece of single-threaded work takes now (median of `rounds`, ~0.1 s each): the machine's
    own speed at that moment. On this VM it varies by up to 2x with the machine idle, which no other process's CPU
    time shows (the host's contention is not reported as steal), so each run records it beside its result."""
    times = []
    for _ in range(rounds):
        began, digest = time.perf_counter(), b"pdcluster"
        for _ in range(200_000):
            digest = hashlib.sha256(digest).digest()
        times.append(time.perf_counter() - began)
    return round(1000 * statistics.median(times), 1)


def own_cpu_seconds(pids: dict[str, int]) -> float:
    """This process (the load generator) and every process tree under test."""
    me = psutil.Process().cpu_times()
    return me.user + me.system + sum(tree_cpu_seconds(pid) for pid in pids.values())


class Window:
    """CPU used during a stretch of time: by each process tree under test, and by everything else on the machine."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.start = time.monotonic()
        self.trees = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        self.machine, self.own = busy_cpu_seconds(), own_cpu_seconds(pids)

    def cores(self) -> dict:
        wall = time.monotonic() - self.start
        trees = {name: round((tree_cpu_seconds(pid) - self.trees[name]) / wall, 4) for name, pid in self.pids.items()}
        machine = (busy_cpu_seconds() - self.machine) / wall
        others = max(0.0, machine - (own_cpu_seconds(self.pids) - self.own) / wall)
        return {"seconds": round(wall, 1), "per_tree": trees, "machine": round(machine, 3),
                "others": round(others, 3)}


def _per_process(pids: dict[str, int]) -> dict[str, tuple[psutil.Process, float]]:
    found = {}
    for name, pid in pids.items():
        for p in tree(pid):
            try:
                t = p.cpu_times()
                found[f"{name}/{p.pid} {p.name()}"] = (p, t.user + t.system)
            except psutil.NoSuchProcess:
                pass
    return found


def _per_thread_kind(pids: dict[str, int]) -> tuple[dict[str, float], Counter]:
    """CPU seconds and thread counts per (tree, process name, thread name): threads of one kind wake alike (torch's
    gloo event loops, ZMQ's I/O threads), so a kind's sum says what its wake-ups cost."""
    seconds: dict[str, float] = defaultdict(float)
    threads: Counter = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for name, pid in pids.items():
        for p in tree(pid):
            try:
                process = p.name()
                for tid in os.listdir(f"/proc/{p.pid}/task"):
                    with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                        stat = f.read()
                    thread = stat[stat.index("(") + 1:stat.rindex(")")]
                    fields = stat[stat.rindex(")") + 2:].split()
                    key = f"{name} {process} {thread}"
                    seconds[key] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
                    threads[key] += 1
            except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                pass
    return seconds, threads


def measure_idle(pids: dict[str, int], seconds: float) -> dict:
    """Cores each process tree used while nothing was asked of it (its health probes, heartbeats, polling), and
    which processes of the trees used them (SGLang names its scheduler and detokenizer processes)."""
    window, before, threads_before = Window(pids), _per_process(pids), _per_thread_kind(pids)[0]
    time.sleep(seconds)
    after, (threads_after, counts) = _per_process(pids), _per_thread_kind(pids)
    cores = window.cores()
    busiest = {k: round((after[k][1] - before[k][1]) / cores["seconds"], 4) for k in after if k in before}
    cores["per_process"] = dict(sorted(((k, v) for k, v in busiest.items() if v >= 0.002), key=lambda kv: -kv[1]))
    kinds = {f"{k} x{counts[k]}": round((threads_after[k] - threads_before[k]) / cores["seconds"], 4)
             for k in threads_after if k in threads_before}
    cores["per_thread_kind"] = dict(sorted(((k, v) for k, v in kinds.items() if v >= 0.001), key=lambda kv: -kv[1]))
    return cores
