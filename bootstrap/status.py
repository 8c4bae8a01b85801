"""`python -m bootstrap status`: the registry as a table; `drain` and `resume`: a worker out of the routers' pools and
back (the routers follow the registry within a fraction of a second); `switch`: a worker's role flipped live."""

from __future__ import annotations

import sys
import time

import httpx

from pdcluster.common.protocol import RoleSwitch, WorkerListing, from_newer


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


def switch_role(url: str, worker_id: str, to: str, token: str | None, wait: float) -> int:
    """Ask for the flip, then follow the listing until it ends: one line with the outcome and its timings (the drain
    apart from the switch itself); 0 only when it is done."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = url.rstrip("/")
    try:
        response = httpx.post(f"{base}/v1/workers/{worker_id}/switch", json={"to": to}, headers=headers, timeout=5)
    except httpx.HTTPError as exc:
        print(f"bootstrap: error: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 202:
        error = _error_of(response)
        refusal = f" ({error['refusal']})" if "refusal" in error else ""
        print(f"bootstrap: error: {worker_id}: refused{refusal}: {error.get('message', response.text)}",
              file=sys.stderr)
        return 1
    started = response.json()
    deadline, version = time.monotonic() + wait, None
    while (left := deadline - time.monotonic()) > 0:
        try:
            params = {"timeout": min(left, 10.0), **({"wait_version": version} if version is not None else {})}
            listing = from_newer(WorkerListing, httpx.get(f"{base}/v1/workers", params=params, timeout=15).json())[0]
        except (httpx.HTTPError, ValueError):
            time.sleep(0.5)
            continue
        version = listing.version
        row = next((w for w in listing.workers if w.registration.worker_id == worker_id), None)
        flip = row.switch if row else None
        if flip is not None and flip.state in ("done", "failed"):
            return _print_outcome(worker_id, started["from"], flip)
    print(f"bootstrap: error: {worker_id}: the flip to {to} had not ended after {wait:.0f}s (python -m bootstrap "
          f"status shows how it goes on)", file=sys.stderr)
    return 1


def _print_outcome(worker_id: str, was: str, flip: RoleSwitch) -> int:
    ended = flip.ended or time.time()
    drained = (flip.switching_at or ended) - flip.started
    timings = f"drained in {drained:.2f}s, switched in {ended - (flip.switching_at or ended):.2f}s"
    if flip.state == "done":
        print(f"{worker_id}: {was} -> {flip.to.value} done: {timings} ({ended - flip.started:.2f}s in all)")
        return 0
    print(f"bootstrap: error: {worker_id}: the flip to {flip.to.value} failed: {flip.reason} ({timings})",
          file=sys.stderr)
    return 1


def _error_of(response: httpx.Response) -> dict:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": f"{response.status_code}: {response.text[:500]}"}
    return error if isinstance(error, dict) else {"message": str(error)}
