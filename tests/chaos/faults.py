"""tests.chaos: the faults (SIGSTOP of a tree or of a scheduler, kill -9, restarts, a network drop) and the
timings each must meet: out of rotation within DETECT_LIMIT, every worker serving again within its limit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import psutil

from bench.harness.procs import tree
from pdcluster.local.cluster import LocalCluster
from tests.chaos.cluster import DETECT_LIMIT, HANG_SECONDS, LIMITS, all_serving, registered, sglang_main, worker_healthy
from tests.chaos.load import Load
from tests.chaos.probes import Probes
from tests.helpers import seconds_until, worker_url


@dataclass
class FaultResult:
    name: str
    kind: str
    target: str
    injected_at: float  # seconds since the load started
    detected_s: float | None = None  # injection -> out of rotation
    resumed_at: float | None = None  # SIGCONT / network back (hangs and network faults)
    recovered_s: float | None = None  # injection (or resume) -> every worker serving again
    recovered_at: float | None = None
    limit_detect_s: float | None = None
    limit_recover_s: float = 0.0
    restarts: int = 0  # restarts by the local cluster's supervisor during this fault
    ok: bool = False
    notes: list[str] = field(default_factory=list)


class Chaos:
    def __init__(self, cluster: LocalCluster, load: Load, probes: Probes, log):
        self.cluster, self.load, self.probes, self.log = cluster, load, probes, log
        self.results: list[FaultResult] = []

    def run(self, fault: str) -> FaultResult:
        kind, target = fault.split(" ", 1)
        result = FaultResult(fault, kind, target, self.load.now())
        before = sum(self.cluster.restarts().values())
        self.log(f"fault: {fault}")
        getattr(self, f"_{kind}")(target, result)
        result.restarts = sum(self.cluster.restarts().values()) - before
        if result.recovered_s is not None:
            result.recovered_at = self.load.now()
        result.ok = (result.recovered_s is not None and result.recovered_s <= result.limit_recover_s
                     and (result.limit_detect_s is None or (result.detected_s is not None
                                                            and result.detected_s <= result.limit_detect_s)))
        self.log(f"  {'ok' if result.ok else 'FAILED'}: detected {result.detected_s} s, recovered "
                 f"{result.recovered_s} s, restarts {result.restarts} {'; '.join(result.notes)}")
        self.results.append(result)
        return result

    def _out_of_rotation(self, url: str, result: FaultResult, began: float) -> None:
        result.limit_detect_s = DETECT_LIMIT
        seen = seconds_until(lambda: worker_healthy(self.cluster.router_url, url) is not True, DETECT_LIMIT + 20, 0.1)
        result.detected_s = None if seen is None else round(time.monotonic() - began, 2)

    def _stall(self, name: str, result: FaultResult) -> None:
        """SIGSTOP of the worker's scheduler only: its HTTP side (and launcher) go on answering."""
        self._hang(name, result, only=lambda p: p.name().startswith("sglang::sched"))

    def _hang(self, name: str, result: FaultResult, only=None) -> None:
        url = worker_url(self.cluster, name)
        processes = [p for p in tree(self.cluster.processes[name].popen.pid) if only is None or only(p)]
        if not processes:
            result.notes.append("no process to stop")
            return
        result.notes.append(f"stopped {', '.join(sorted({p.name() for p in processes}))}")
        began = time.monotonic()
        for p in processes:
            p.suspend()  # the launcher too: no heartbeats either, as when a machine stalls
        try:
            self._out_of_rotation(url, result, began)
            time.sleep(max(0.0, HANG_SECONDS - (time.monotonic() - began)))
        finally:
            for p in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.resume()
        result.resumed_at = self.load.now()
        resumed = time.monotonic()
        self.probes.exclude(name, result.injected_at, result.resumed_at)
        result.limit_recover_s = LIMITS[result.kind]
        took = seconds_until(lambda: all_serving(self.cluster), LIMITS[result.kind] + 30)
        result.recovered_s = None if took is None else round(time.monotonic() - resumed, 2)

    def _kill(self, name: str, result: FaultResult) -> None:
        url = worker_url(self.cluster, name)
        victim = sglang_main(self.cluster, name)
        if victim is None:
            result.notes.append("no SGLang process found")
            return
        began = time.monotonic()
        victim.send_signal(signal.SIGKILL)  # SGLang crashes; its launcher exits; nobody asked for it
        self._out_of_rotation(url, result, began)
        result.limit_recover_s = LIMITS["kill"]
        took = seconds_until(lambda: self.cluster.processes[name].restarts > 0 and all_serving(self.cluster),
                        LIMITS["kill"] + 60, 0.5)
        result.recovered_s = None if took is None else round(time.monotonic() - began, 2)
        self.probes.exclude(name, result.injected_at, self.load.now())

    def _restart(self, name: str, result: FaultResult) -> None:
        process = self.cluster.processes[name]
        began = time.monotonic()
        os.kill(process.popen.pid, signal.SIGTERM)  # not through the cluster: to it, an exit nobody asked for
        want = self.cluster.spec.prefill.count + self.cluster.spec.decode.count
        result.limit_recover_s = LIMITS[name]
        if name == "bootstrap":
            def back() -> bool:
                return process.restarts > 0 and registered(self.cluster) == want and all_serving(self.cluster)
        else:
            def back() -> bool:
                return process.restarts > 0 and all_serving(self.cluster)
        took = seconds_until(back, LIMITS[name] + 60, 0.2)
        result.recovered_s = None if took is None else round(time.monotonic() - began, 2)

    def _network(self, name: str, result: FaultResult) -> None:
        """Drop what the prefills send to the decode's Mooncake transfer ports for HANG_SECONDS (iptables)."""
        ports = mooncake_ports(self.cluster, name)
        if not ports:
            result.notes.append("no Mooncake port found")
            return
        rules = [["-p", "tcp", "-d", "127.0.0.1", "--dport", str(port), "-m", "comment", "--comment",
                  "pdcluster-chaos", "-j", "DROP"] for port in ports]
        began = time.monotonic()
        try:
            for rule in rules:
                subprocess.run(["iptables", "-I", "OUTPUT", *rule], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            result.notes.append(f"iptables refused: {exc}")
            return
        try:
            result.notes.append(f"dropped tcp to 127.0.0.1 ports {ports}")
            time.sleep(HANG_SECONDS)
        finally:
            for rule in rules:
                subprocess.run(["iptables", "-D", "OUTPUT", *rule], capture_output=True)
        result.resumed_at = self.load.now()
        resumed = time.monotonic()
        result.limit_recover_s = LIMITS["network"]
        took = seconds_until(lambda: all_serving(self.cluster), LIMITS["network"] + 30)
        result.recovered_s = None if took is None else round(time.monotonic() - resumed, 2)
        result.notes.append(f"injected for {resumed - began:.0f}s")


def mooncake_ports(cluster: LocalCluster, name: str) -> list[int]:
    """TCP ports the worker's scheduler listens on for Mooncake transfers (not its HTTP/ZMQ loopback ports)."""
    ports = set()
    for p in tree(cluster.processes[name].popen.pid):
        try:
            if "sched" not in p.name():
                continue
            for conn in p.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.ip in ("0.0.0.0", "::"):
                    ports.add(conn.laddr.port)
        except psutil.Error:
            continue
    return sorted(ports)


def clean_iptables() -> None:
    """Remove rules a previous run left behind (it was killed mid-fault)."""
    try:
        listing = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return
    for line in listing.splitlines():
        if "pdcluster-chaos" in line and line.startswith("-A "):
            subprocess.run(["iptables", "-D", *line.split()[1:]], capture_output=True)


