"""Keep a worker's entry in the bootstrap service true: register once SGLang answers, heartbeat, deregister on exit.

Two threads: one probes SGLang's /health (which runs a real one-token generation, so it takes a second or more, and
longer under load), the other heartbeats on a fixed beat with the last probe's verdict. Keeping them apart means a
slow probe never makes the worker miss heartbeats and drop out of the registry.

The bootstrap service may restart at any time: a heartbeat answered with 404 means it forgot us, and we register
again, so a restarted service is whole again within one heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from pdcluster.common import otel
from pdcluster.common.protocol import KVStoreMembership, Role, RoleSwitch
from pdcluster.kvstore.secret_proof import MEMBERSHIP_ENV
from pdcluster.worker.plan import LaunchPlan

log = logging.getLogger("pdcluster.worker")

# How long one /health probe may take. SGLang's /health waits for any output of its scheduler, so one long forward
# pass (a long prompt of a real model on a CPU: tens of seconds) keeps it waiting; the launcher raises SGLang's own
# limit (SGLANG_HEALTH_CHECK_TIMEOUT, pdcluster/worker/plan.py) well past this one.
HEALTH_PROBE_TIMEOUT = 25.0
# A probe that fails while SGLang's processes used at least this share of a core meanwhile is a busy scheduler, not
# a dead one (a stuck or stopped one uses next to none; an idle one with sleep-on-idle ~0.03; one in a forward pass
# a core or more, though less on a machine its cores are shared on).
BUSY_CORES = 0.1
# A registration the bootstrap service keeps refusing is logged again after this many seconds, not at every heartbeat.
REFUSAL_REMINDER = 60.0


def forward_tokens(server_info: dict, context_length: int | None) -> int | None:
    """The most prompt tokens one of SGLang's forward passes computes: its chunked prefill size; without chunking, a
    whole prompt (up to the context length) or a batch of max_prefill_tokens, whichever is larger."""
    chunk, batch = server_info.get("chunked_prefill_size"), server_info.get("max_prefill_tokens")
    if isinstance(chunk, int) and chunk > 0:
        return chunk
    known = [n for n in (batch, context_length) if isinstance(n, int) and n > 0]
    return max(known) if known else None


class Registrar:
    def __init__(self, plan: LaunchPlan, probe_timeout: float = HEALTH_PROBE_TIMEOUT,
                 on_flip: Callable[[RoleSwitch], None] = lambda order: None):
        """`on_flip`: carries out a role flip the registry orders (pdcluster/worker/role_flip.py, wired by cli.py)."""
        self.plan, self.probe_timeout, self.on_flip = plan, probe_timeout, on_flip
        self._flips_seen: set[float] = set()  # the flips taken on (by their start), so each runs once
        self.registration = plan.registration
        token = plan.cluster.resolved_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.service = httpx.Client(base_url=plan.cluster.bootstrap_url or "", headers=headers, timeout=3.0)
        self._stop = threading.Event()
        self._leaving = threading.Event()
        self._writing = threading.Lock()  # one registry write at a time: a heartbeat's, or leave_pools()'s
        self._serving = threading.Event()
        self.health: tuple[bool, str] = (False, "starting")
        self.traced = "--enable-trace" in plan.command  # then each probe says "not sampled" (otel.unsampled)
        self.registered = False
        self._threads = [threading.Thread(target=self._probe_loop, name="health-probe", daemon=True),
                         threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)]
        self._sglang: psutil.Process | None = None
        # Where the kvstore launch step writes the KV namespace and secret proof this worker registers (child_env).
        self.kv_store_file = Path(tempfile.gettempdir()) / f"pdcluster-kv-{uuid.uuid4().hex}.json"
        self._last_refusal: tuple[int, str] | None = None  # the last refusal logged, and when (REFUSAL_REMINDER)
        self._refusal_logged = 0.0

    def child_env(self) -> dict[str, str]:
        """What SGLang's command gets in its environment for the registrar (the kvstore launch step pops it)."""
        return {MEMBERSHIP_ENV: str(self.kv_store_file)}

    def start(self, proc: subprocess.Popen | None = None) -> None:
        self.adopt(proc)
        for thread in self._threads:
            thread.start()

    def adopt(self, proc: subprocess.Popen | None) -> None:
        """The SGLang process whose CPU time the health verdict reads (again after a restart)."""
        if proc is not None:
            self._sglang = psutil.Process(proc.pid)

    def _cpu_seconds(self) -> float:
        """CPU time SGLang's processes have used so far (0 if unknown)."""
        if self._sglang is None:
            return 0.0
        total = 0.0
        try:
            for process in [self._sglang, *self._sglang.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    total += times.user + times.system
        except psutil.Error:
            pass
        return total

    def leave_pools(self) -> None:
        """Deregister now: the worker is about to stop and drain, and the routers must send it nothing new (the
        requests they have open on it run on). Runs in a signal handler: one short request, never an exception."""
        with self._writing:
            self._leaving.set()  # no heartbeat registers it again
            if not self.registered:
                return
            try:
                self.service.delete(f"/v1/workers/{self.registration.worker_id}", timeout=2.0)
                self.registered = False
            except httpx.HTTPError as exc:
                log.warning("could not leave the routers' pools before stopping: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.kv_store_file.unlink(missing_ok=True)
        if self.registered:
            try:
                self.service.delete(f"/v1/workers/{self.registration.worker_id}")
            except httpx.HTTPError as exc:
                log.warning("could not deregister %s: %s", self.registration.worker_id, exc)

    def _probe(self, client: httpx.Client) -> tuple[bool, str]:
        started, cpu = time.monotonic(), self._cpu_seconds()
        try:
            response = client.get(self.plan.health_url, headers=otel.unsampled() if self.traced else None)
        except httpx.TimeoutException:
            used = (self._cpu_seconds() - cpu) / max(time.monotonic() - started, 1e-3)
            if used >= BUSY_CORES:  # its scheduler is in a long forward pass: busy, not broken
                return True, f"busy: /health waited {self.probe_timeout:.0f}s while SGLang used {used:.1f} cores"
            return False, f"SGLang /health timed out and SGLang used {used:.2f} cores meanwhile"
        except httpx.HTTPError as exc:
            return False, f"SGLang /health unreachable: {type(exc).__name__}"
        ok = response.status_code == 200
        return ok, "" if ok else f"SGLang /health {response.status_code}"

    def _probe_loop(self) -> None:
        deadline = time.monotonic() + self.plan.cluster.ready_timeout
        with httpx.Client(timeout=self.probe_timeout) as client:
            while not self._stop.is_set():
                self.health = self._probe(client)
                if self.health[0]:
                    self._serving.set()
                elif not self._serving.is_set() and time.monotonic() > deadline:
                    log.error("SGLang did not answer /health within %.0fs; not registering",
                              self.plan.cluster.ready_timeout)
                    return
                serving = self._serving.is_set() and self.health[0]
                self._stop.wait(self.plan.cluster.health_interval if serving else self.plan.cluster.heartbeat_interval)

    def _read_kv_pool(self) -> None:
        """The KV pool SGLang sized at start (from free memory, capped by --max-total-tokens): the router needs it to
        keep prompts a decode can never pre-allocate away from it (router/pd/kv_fit.py); and the largest forward pass,
        which tells the router how long a working prefill may be silent (router/fleet/liveness.py). Read once, before
        the
        first registration; unknown (None) if SGLang does not say."""
        if self.registration.kv_pool_tokens is not None:
            return
        try:
            info = httpx.get(f"{self.registration.base_url}/server_info", timeout=30.0).json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("SGLang /server_info unreadable (%s): the router will not know the KV pool's size", exc)
            return
        pool, reserved = info.get("max_total_num_tokens"), info.get("num_reserved_decode_tokens")
        update = {"kv_pool_tokens": pool if isinstance(pool, int) and pool > 0 else None,
                  "forward_tokens": forward_tokens(info, self.registration.context_length)}
        if self.registration.role is Role.DECODE and isinstance(reserved, int) and reserved >= 0:
            update["reserved_decode_tokens"] = reserved
        self.registration = self.registration.model_copy(update=update)
        budget = self.registration.prompt_budget
        if budget is not None:
            log.warning("the KV pool holds %s tokens, less than the context length (%s) plus the %s tokens SGLang "
                        "reserves with each prompt: prompts over %s tokens are sent to other decodes, or refused "
                        "(400) by the router. More free RAM (or GPU memory) at start, or a larger "
                        "--max-total-tokens, lifts this.", pool, self.registration.context_length, reserved, budget)

    def _read_kv_store(self) -> None:
        """The KV namespace and secret proof the kvstore launch step wrote before SGLang started (none: the worker
        keeps no KV on disk), read once, before the first registration."""
        if self.registration.kv_store is not None or not self.kv_store_file.exists():
            return
        try:
            membership = KVStoreMembership.model_validate_json(self.kv_store_file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("the KV store's namespace is unreadable (%s): its secret is not checked against the other "
                        "workers'", exc)
            return
        self.registration = self.registration.model_copy(update={"kv_store": membership})

    def _register(self) -> None:
        self._read_kv_pool()
        self._read_kv_store()
        response = self.service.put(f"/v1/workers/{self.registration.worker_id}",
                                    content=self.registration.model_dump_json(),
                                    headers={"content-type": "application/json"})
        if response.status_code >= 400:
            self._refused(response)
            return
        self.registered = True
        self._last_refusal = None
        incompatible = response.json().get("incompatible")
        if incompatible:
            log.warning("%s cannot be paired: %s", self.registration.worker_id, incompatible)
        log.info("registered %s as %s", self.registration.worker_id, self.registration.url)

    def _refused(self, response: httpx.Response) -> None:
        """A refusal (a bad token, a KV secret that differs from its namespace's other workers', ...) is logged as an
        error once, and again every REFUSAL_REMINDER seconds while it lasts, not at every heartbeat; the heartbeats
        keep asking, so the worker joins once the cause is gone (e.g. the namespace's other workers stopped). SGLang
        keeps running meanwhile, unused: the routers never hear of it."""
        try:
            reason = str(response.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            reason = response.text[:500]
        refusal, now = (response.status_code, reason), time.monotonic()
        if refusal == self._last_refusal and now - self._refusal_logged < REFUSAL_REMINDER:
            log.debug("registration refused again (%s)", response.status_code)
            return
        self._last_refusal, self._refusal_logged = refusal, now
        log.error("bootstrap service refused to register %s (%s): %s; the worker gets no traffic until it accepts "
                  "(asking again every %ss)", self.registration.worker_id, response.status_code, reason,
                  self.plan.cluster.heartbeat_interval)

    def _heartbeat_loop(self) -> None:
        while not self._serving.is_set():
            if self._stop.wait(0.5):
                return
        while not self._stop.is_set():
            with self._writing:  # never a registration after leave_pools()
                if self._leaving.is_set():
                    return
                try:
                    if not self.registered:
                        self._register()
                    else:
                        healthy, detail = self.health
                        response = self.service.post(f"/v1/workers/{self.registration.worker_id}/heartbeat",
                                                     json={"healthy": healthy, "detail": detail})
                        if response.status_code == 404:
                            self.registered = False
                            continue
                        self._take_flip(response)
                except httpx.HTTPError as exc:
                    log.debug("bootstrap service unreachable: %s", exc)
            self._stop.wait(self.plan.cluster.heartbeat_interval)

    def _take_flip(self, response: httpx.Response) -> None:
        """A heartbeat's answer names the role flip the registry wants of this worker (bootstrap/switch.py): handed
        to `on_flip` once."""
        try:
            order = response.json().get("switch")
            flip = RoleSwitch.model_validate(order) if order is not None and self.plan.flip is not None else None
        except ValueError:  # not JSON, or not a flip this launcher knows how to carry out
            return
        if flip is not None and flip.started not in self._flips_seen:
            self._flips_seen.add(flip.started)
            self.on_flip(flip)
