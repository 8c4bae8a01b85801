"""The workers as the live planner sees them: the bootstrap service's listing (GET /v1/workers), the split it makes,
which worker's flip costs least, and the flip request itself (POST /v1/workers/{id}/switch).

A row's `switch` is its last role flip (pdcluster.common.protocol.RoleSwitch: draining, switching, done or failed,
and why). A worker whose switch is running counts as its new role already (as the simulator counts it), so that a
decision in the meantime does not ask for the same flip twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from pdcluster.common.protocol import RoleSwitch, WorkerListing, from_newer
from planner.scrape import Scrape
from planner.sizing import Split

RUNNING = ("draining", "switching")  # a switch's states while it is under way


@dataclass(frozen=True)
class Row:
    worker_id: str
    role: str  # the registration's
    url: str
    serving: bool  # healthy, compatible and not taken out by an operator
    switch_enabled: bool  # started with SGLang's role switch (the bootstrap service refuses to flip any other)
    switch: RoleSwitch | None = None

    @property
    def switching(self) -> bool:
        return self.switch is not None and self.switch.state in RUNNING

    @property
    def headed(self) -> str:
        """Its role once a running switch is done."""
        return self.switch.to.value if self.switching and self.switch else self.role


def read_rows(client: httpx.Client, bootstrap_url: str) -> list[Row]:
    response = client.get(f"{bootstrap_url.rstrip('/')}/v1/workers")
    response.raise_for_status()
    listing, _ = from_newer(WorkerListing, response.json())
    return [Row(worker_id=w.registration.worker_id, role=w.registration.role.value, url=w.registration.base_url,
                serving=w.healthy and not w.draining and not w.incompatible,
                switch_enabled=w.registration.switch_enabled, switch=w.switch)
            for w in listing.workers]


def observed_split(rows: list[Row]) -> Split:
    """Workers per role: serving ones by their role, switching ones by the role they are headed to."""
    counted = [r.headed for r in rows if r.serving or r.switching]
    return Split(prefill=counted.count("prefill"), decode=counted.count("decode"))


def fixed_split(rows: list[Row]) -> Split:
    """The serving workers that cannot flip, per role (a role-flexible pool's fixed ones: the chart's
    workers.pool.minPerRole): a pool autoscaler adds switch-enabled workers only beyond them."""
    fixed = [r.role for r in rows if r.serving and not r.switch_enabled]
    return Split(prefill=fixed.count("prefill"), decode=fixed.count("decode"))


def loss_cost(row: Row, scrape: Scrape) -> tuple[float, float, float]:
    """What flipping `row` loses, to compare workers of one role: its requests in flight (each waits out the drain),
    then its cached prefix by the router's KV index (a flipped worker starts cold), then its queued prefill work."""
    return (scrape.in_flight.get(row.url, 0.0), scrape.kv_pages.get(row.worker_id, 0.0),
            scrape.queued_tokens.get(row.url, 0.0))


def cheapest(rows: list[Row], role: str, scrape: Scrape) -> Row | None:
    """The serving, switch-enabled worker of `role` whose flip costs least (ties: the first id, so that a decision
    repeats); one started without the switch would only be refused."""
    candidates = [r for r in rows if r.role == role and r.serving and not r.switching and r.switch_enabled]
    return min(candidates, key=lambda r: (loss_cost(r, scrape), r.worker_id), default=None)


@dataclass(frozen=True)
class SwitchAnswer:
    accepted: bool
    code: str  # the 409's error code (last_of_role, switch_running, ...), "http_<status>", or "unreachable"
    message: str


def request_switch(client: httpx.Client, bootstrap_url: str, worker_id: str, to: str,
                   token: str | None) -> SwitchAnswer:
    """Ask the bootstrap service to flip `worker_id` to `to`; 202 is accepted, anything else says why not."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = client.post(f"{bootstrap_url.rstrip('/')}/v1/workers/{worker_id}/switch", json={"to": to},
                               headers=headers)
    except httpx.HTTPError as exc:
        return SwitchAnswer(False, "unreachable", f"{type(exc).__name__}: {exc}")
    if response.status_code == 202:
        return SwitchAnswer(True, "accepted", f"{worker_id} draining to {to}")
    try:
        error = response.json().get("error", {})
    except ValueError:
        error = {}
    error = error if isinstance(error, dict) else {}
    code = error.get("refusal")  # the stable reason; `code` is the HTTP status, as in every pdcluster error
    code = code if isinstance(code, str) else f"http_{response.status_code}"
    return SwitchAnswer(False, code, str(error.get("message") or response.text[:200]))
