"""A role flip as the worker's launcher carries it out: it owns the SGLang process and the registration, so the
registry (bootstrap/switch.py) hands it the order in a heartbeat's answer and it does the rest.

The registry drained the worker when it took the order. The launcher gives the routers a moment to follow that drain
(a request picked just before it may still arrive), then waits for SGLang's own word that it is idle: a router's
in-flight count is not enough (SGLang stays "not idle" a while after the last request). It asks SGLang to switch
(POST /pd_role_switch; no CUDA graphs on CPU, so `decode_cuda_graph_memory_gb: 0`), waits for /health, and registers
the worker again under its new role as a new instance: the routers drop the old one and admit this one through their
canary, and the registry ends the flip and its drain. `/server_info` keeps the old role after a flip, so the role is
known from the switch's answer, never from there.

What can go wrong: SGLang stays busy past IDLE_TIMEOUT, or refuses for another reason before changing anything: the
flip fails with SGLang's reason and the worker serves on in its old role. A switch that fails half-way
(`safe_to_restore` false, no answer, or no /health after it): SGLang is restarted with its launch command, so in its
old role unless an earlier flip changed it, registered as a new instance, and the failure says so. Meanwhile the
supervisor holds (`mid_flip`): SGLang exiting then is this flip's to restore, not the worker's end.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from pdcluster.common.protocol import Role, RoleSwitch, SwitchProgress
from pdcluster.worker.switching import registration_as

if TYPE_CHECKING:
    from pdcluster.worker.registrar import Registrar

log = logging.getLogger("pdcluster.worker")

ROUTERS_FOLLOW = 1.0  # seconds for the routers to see the drain (they long-poll the registry)
IDLE_TIMEOUT = 120.0  # how long SGLang may stay "not idle" before the flip is given up (bootstrap/switch.py: less)
POLL = 0.2
SWITCH_TIMEOUT = 120.0  # one /pd_role_switch: the teardown and the new role's queues, seconds on a CPU
HEALTH_TIMEOUT = 120.0  # for SGLang to serve again after a switch


class FlipFailed(Exception):
    """The flip cannot go on; `restore`: SGLang may be half-switched and must be restarted in its old role."""

    def __init__(self, reason: str, restore: bool = False):
        super().__init__(reason)
        self.restore = restore


class RoleFlip:
    def __init__(self, registrar: Registrar, order: RoleSwitch, restart: Callable[[], None],
                 mid_flip: threading.Event | None = None):
        self.registrar, self.order, self.restart = registrar, order, restart
        self.mid_flip = mid_flip or threading.Event()  # the supervisor's: SGLang may be half-switched
        self.idle_timeout, self.routers_follow = IDLE_TIMEOUT, ROUTERS_FOLLOW
        self.sglang = registrar.registration.base_url
        self.was: Role = registrar.registration.role

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="role-flip", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        to = self.order.to
        log.warning("flipping %s from %s to %s: waiting for SGLang to be idle", self.registrar.registration.worker_id,
                    self.was.value, to.value)
        try:
            with httpx.Client(timeout=SWITCH_TIMEOUT) as client:
                time.sleep(self.routers_follow)
                self._until_idle(client)
                self._report(SwitchProgress(state="switching"))
                started = time.monotonic()
                self.mid_flip.set()
                self._switch(client)
                self._until_healthy(client)
            self._register_as(to)
            log.warning("flipped to %s in %.2fs", to.value, time.monotonic() - started)
        except FlipFailed as exc:
            reason = str(exc)
            if exc.restore:
                reason = self._restore(reason)
            log.error("role flip to %s failed: %s", to.value, reason)
            self._report(SwitchProgress(state="failed", reason=reason[:2000]))
        finally:
            self.mid_flip.clear()

    def _ask(self, client: httpx.Client, prepare_only: bool) -> dict:
        body = {"new_role": self.order.to.value, "prepare_only": prepare_only, "decode_cuda_graph_memory_gb": 0}
        try:
            answer = client.post(f"{self.sglang}/pd_role_switch", json=body).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise FlipFailed(f"SGLang's /pd_role_switch did not answer: {type(exc).__name__}: {exc}",
                             restore=not prepare_only) from None
        return answer if isinstance(answer, dict) else {"success": False, "message": str(answer)[:500]}

    def _until_idle(self, client: httpx.Client) -> None:
        """SGLang's checks, changing nothing (`prepare_only`), until they pass or the wait is over."""
        deadline = time.monotonic() + self.idle_timeout
        while not (answer := self._ask(client, prepare_only=True)).get("success"):
            message = str(answer.get("message", ""))
            if "not idle" not in message:
                raise FlipFailed(f"SGLang refused: {message}")
            if time.monotonic() > deadline:
                raise FlipFailed(f"SGLang was not idle within {self.idle_timeout:.0f}s of the drain: {message}")
            time.sleep(POLL)

    def _switch(self, client: httpx.Client) -> None:
        deadline = time.monotonic() + self.idle_timeout
        while not (answer := self._ask(client, prepare_only=False)).get("success"):
            message = str(answer.get("message", ""))
            if not answer.get("safe_to_restore", False):
                raise FlipFailed(f"SGLang's switch failed half-way: {message}", restore=True)
            if "not idle" not in message or time.monotonic() > deadline:  # nothing changed: it serves on as it was
                raise FlipFailed(f"SGLang refused: {message}")
            time.sleep(POLL)

    def _until_healthy(self, client: httpx.Client) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if client.get(f"{self.sglang}/health", timeout=30.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL)
        raise FlipFailed(f"SGLang did not answer /health within {HEALTH_TIMEOUT:.0f}s of its switch", restore=True)

    def _register_as(self, role: Role) -> None:
        """Registered anew, as a new instance (the registry ends the flip when the role is the new one); if the
        bootstrap service cannot be reached now, the next heartbeat registers it."""
        registrar = self.registrar
        flip = registrar.plan.flip
        assert flip is not None  # a worker that is not switch-enabled is refused before anything changes
        with registrar._writing:
            registrar.registration = registration_as(role, registrar.registration, flip).model_copy(
                update={"instance_id": uuid.uuid4().hex})
            registrar.registered = False
            with contextlib.suppress(httpx.HTTPError):
                registrar._register()

    def _restore(self, reason: str) -> str:
        """SGLang restarted with its launch command, so in the role it was started in (its old role unless an
        earlier flip changed it), and registered so once it serves; the reason, saying so."""
        started_as = self.registrar.plan.role
        role = (f"its old role ({self.was.value})" if started_as is self.was else
                f"the role it was started in ({started_as.value}), not its old one ({self.was.value})")
        log.error("role flip failed half-way (%s): restarting SGLang in %s", reason, role)
        self.restart()
        deadline = time.monotonic() + self.registrar.plan.cluster.ready_timeout
        with httpx.Client(timeout=30.0) as client:
            while time.monotonic() < deadline:
                try:
                    if client.get(f"{self.sglang}/health").status_code == 200:
                        reason = f"{reason}; the launcher restarted SGLang in {role}"
                        if started_as is self.order.to:  # its registration would end the flip as done: failed first
                            self._report(SwitchProgress(state="failed", reason=reason[:2000]))
                        self._register_as(started_as)
                        return reason
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        return f"{reason}; the launcher restarted SGLang in {role}, which did not serve again"

    def _report(self, progress: SwitchProgress) -> None:
        worker_id = self.registrar.registration.worker_id
        try:
            self.registrar.service.post(f"/v1/workers/{worker_id}/switch/progress",
                                        content=progress.model_dump_json(),
                                        headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:  # the registry gives the flip up at its deadline
            log.warning("could not tell the bootstrap service the flip is %s: %s", progress.state, exc)
