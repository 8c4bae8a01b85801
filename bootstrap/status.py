"""`python -m bootstrap status`: the registry as a table; `drain` and `resume`: a worker out of the routers' pools and
back (the routers follow the registry within a fraction of a second)."""

from __future__ import annotations

import sys
import time

import httpx

from pdcluster.common.protocol import WorkerListing, from_newer


def format_table(listing: WorkerListing, now: float | None = None) -> str:
    now = now or time.time()
    rows = [("ROLE", "WORKER", "URL", "MODEL", "HEALTH", "AGE", "NOTE")]
    for w in sorted(listing.workers, key=lambda w: (w.registration.role.value, w.registration.worker_id)):
        reg = w.registration
        rows.append((
            reg.role.value, reg.worker_id, reg.base_url, reg.identity.served_model_name,
            ("healthy" if w.healthy else "unhealthy") + (", draining" if w.draining else ""),
            f"{now - w.registered_at:.0f}s",
            w.incompatible or w.detail,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([*lines, f"(registry version {listing.version}, {len(listing.workers)} workers)"])


def print_status(url: str) -> int:
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/workers", timeout=5)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"bootstrap: error: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    print(format_table(from_newer(WorkerListing, response.json())[0]))
    return 0


def set_draining(url: str, worker_id: str, draining: bool, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    method = "POST" if draining else "DELETE"
    try:
        response = httpx.request(method, f"{url.rstrip('/')}/v1/workers/{worker_id}/drain", headers=headers,
                                 timeout=5)
    except httpx.HTTPError as exc:
        print(f"bootstrap: error: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"bootstrap: error: {response.status_code}: {response.text}", file=sys.stderr)
        return 1
    print(f"{worker_id}: {'draining: no new requests; it finishes what it has' if draining else 'back in the pools'}")
    return 0
