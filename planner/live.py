"""The live planner's interval: read the router's metrics and the registry, let the sizing core decide (planner/
sizing.py: the same decide() the simulator's planner policy runs, so one place sizes the split), export and log the
decision, and in mode `act` flip one worker toward it through the bootstrap service.

Acting: one flip at a time (none while the registry shows a switch running or the last one asked for is not over);
the worker that loses least (planner/fleet.py's cheapest); never the last of its role (the sizing never wants fewer
than one per role, and the bootstrap service refuses it too). A refused or failed flip is logged with its reason and
counted, and no flip is asked for again within the dwell time. In mode `recommend` nothing is asked of anybody.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from pdcluster.common.capacity import Profile
from planner.config import PlannerConfig
from planner.exported import PlannerMetrics
from planner.fleet import Row, cheapest, fixed_split, observed_split, read_rows, request_switch
from planner.scrape import Scrape, Windower, merged, parse
from planner.sizing import Decision, Observation, PlannerState, decide, pool_size

log = logging.getLogger("pdcluster.planner")
HISTORY = 100  # intervals kept: more than the predictors' window and the correction's ever look at


@dataclass
class Flip:
    worker_id: str
    to: str
    asked_at: float


def router_urls(router_url: str) -> list[str]:
    """The router URL once per address its name resolves to (IPv4 when it has any, so that a dual-stack name is not
    counted twice): a headless Service or compose's --scale names every router, and each counts its own requests."""
    parts = urlsplit(router_url.rstrip("/"))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return [router_url.rstrip("/")]
    v4 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET})
    addresses = v4 or sorted({f"[{info[4][0]}]" for info in infos if info[0] == socket.AF_INET6})
    if len(addresses) <= 1:
        return [router_url.rstrip("/")]
    return [f"{parts.scheme}://{address}:{port}" for address in addresses]


class LivePlanner:
    def __init__(self, config: PlannerConfig, profile: Profile, client: httpx.Client,
                 metrics: PlannerMetrics | None = None, clock: Callable[[], float] = time.monotonic):
        self.config, self.profile, self.client, self.clock = config, profile, client, clock
        self.metrics = metrics or PlannerMetrics()
        self.windower = Windower(config.ttft.bound_s, config.itl.bound_s)
        self.state = PlannerState()
        self.history: list[Observation] = []
        self.last_scrape_at: float | None = None
        self.flip: Flip | None = None  # asked for, not yet seen done or failed
        self.no_flip_before = -float("inf")
        self.started = clock()

    def read_routers(self) -> dict[str, Scrape]:
        scrapes = {}
        for url in router_urls(self.config.router_url):
            response = self.client.get(f"{url}/metrics")
            response.raise_for_status()
            scrapes[url] = parse(response.text)
        return scrapes

    def step(self) -> Decision | None:
        """One interval: None on the first (its scrape is the baseline the next one is differenced with) and when
        the fleet has not one worker of each role to split."""
        now = self.clock()
        scrapes, rows = self.read_routers(), read_rows(self.client, self.config.bootstrap_url)
        interval = self.config.interval_s if self.last_scrape_at is None else now - self.last_scrape_at
        self.last_scrape_at = now
        observation = self.windower.observe(scrapes, interval)
        if observation is None:
            log.info("planner: baseline scrape taken; the first decision comes after one interval")
            return None
        self.history = [*self.history, observation][-HISTORY:]
        self._follow_flip(rows, now)
        current = observed_split(rows)
        if current.prefill < 1 or current.decode < 1:
            log.warning(f"planner: hold: the registry lists {current}, not one worker of each role to split")
            return None
        decision, self.state = decide(self.config, self.profile, current, self.state, self.history,
                                      now - self.started)
        reason = decision.reason
        if decision.changes and self.config.mode == "act":
            reason += "; act: " + self._act(decision, rows, merged(scrapes.values()), now)
        elif decision.changes:
            reason += "; recommend: no flip asked for"
        self.metrics.export(decision, current, pool_size(self.config, self.profile, decision), fixed_split(rows),
                            reason)
        log.info(decision.log_line(reason))
        return decision

    def _act(self, decision: Decision, rows: list[Row], scrape: Scrape, now: float) -> str:
        """Ask for one flip toward `decision.desired`; what was done, for the decision's reason."""
        if self.flip is not None or any(r.switching for r in rows):
            return "waiting: a flip is under way"
        if now < self.no_flip_before:
            return f"waiting: the last flip failed or was refused, next try in {self.no_flip_before - now:.0f}s"
        source, target = (("decode", "prefill") if decision.desired.prefill > decision.current.prefill
                          else ("prefill", "decode"))
        worker = cheapest(rows, source, scrape)
        if worker is None:
            return f"no {source} worker can be flipped (none serving)"
        answer = request_switch(self.client, self.config.bootstrap_url, worker.worker_id, target,
                                self.config.resolved_token())
        if answer.accepted:
            self.metrics.flips.labels("accepted").inc()
            self.flip = Flip(worker.worker_id, target, now)
            return f"flipping {worker.worker_id} to {target}"
        self._failed("refused", worker.worker_id, f"{answer.code}: {answer.message}", now)
        return f"{worker.worker_id} to {target} refused ({answer.code}: {answer.message})"

    def _follow_flip(self, rows: list[Row], now: float) -> None:
        """The flip asked for, as the registry now reports it: done, failed, or still running."""
        if self.flip is None:
            return
        flip = self.flip
        row = next((r for r in rows if r.worker_id == flip.worker_id), None)
        state = row.switch.state if row is not None and row.switch is not None else None
        if state == "failed":
            reason = row.switch.reason if row is not None and row.switch is not None else ""
            self._failed("failed", flip.worker_id, reason or "the registry says failed", now)
        elif state == "done" or (row is not None and not row.switching and row.role == flip.to):
            self.metrics.flips.labels("done").inc()
            log.info(f"planner: flip done: {flip.worker_id} serves as {flip.to} "
                     f"{now - flip.asked_at:.0f}s after it was asked for")
            self.flip = None
        elif row is not None and not row.switching:
            self._failed("failed", flip.worker_id, "the registry shows no switch under way", now)
        elif now - flip.asked_at > max(self.config.dwell_s, 10 * self.config.interval_s):
            self._failed("failed", flip.worker_id, "no outcome in the registry", now)

    def _failed(self, result: str, worker_id: str, why: str, now: float) -> None:
        self.metrics.flips.labels(result).inc()
        self.flip = None
        self.no_flip_before = now + self.config.dwell_s  # the dwell starts again
        log.warning(f"planner: flip {result}: {worker_id}: {why}; no flip for {self.config.dwell_s:.0f}s")

    def run(self, stopping: Callable[[], bool], sleep: Callable[[float], None] = time.sleep) -> None:
        """step() every interval until `stopping()`; a step that cannot read its inputs is logged and skipped."""
        while not stopping():
            began = self.clock()
            try:
                self.step()
            except (httpx.HTTPError, ValueError) as exc:
                log.warning(f"planner: skipped an interval: could not read its inputs: {type(exc).__name__}: {exc}")
            next_at = began + self.config.interval_s
            while not stopping() and self.clock() < next_at:
                sleep(min(0.5, max(0.0, next_at - self.clock())))
