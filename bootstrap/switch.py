"""Role flips as the registry keeps them: who may flip now, and each flip's state from the ask to its end.

A flip (`python -m bootstrap switch`, or a planner) drains the worker through the registry; its launcher learns of it
in its heartbeat's answer, waits until SGLang is idle, switches it (state `switching`), and registers the worker anew
under its new role: that registration ends the flip (`done`) and the drain. A launcher that gives up says why
(`failed`), and one that never answers is given up after SWITCH_DEADLINE. Refusals come before anything changes, each
with a stable code a planner can act on (SwitchRefused.code).
"""

from __future__ import annotations

import time

from pdcluster.common.protocol import Role, RoleSwitch, WorkerStatus

# The transfer backends whose KV manager can be torn down and rebuilt in the other role (SGLang 0.5.23: Mooncake's).
SWITCHABLE_BACKENDS = frozenset({"mooncake", "mooncake_tcp"})
RUNNING = ("draining", "switching")
# A flip not ended this long after it was asked is given up (its launcher died, or is older than flips); longer than
# the launcher's own bound on waiting for SGLang to go idle (pdcluster/worker/role_flip.py).
SWITCH_DEADLINE = 300.0


class SwitchRefused(Exception):
    """A flip refused before anything changed; `code` is stable: last_of_role, switch_running, not_switch_enabled,
    backend_cannot, same_role."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def running(switch: RoleSwitch | None) -> bool:
    return switch is not None and switch.state in RUNNING


def check_switch(worker_id: str, to: Role, workers: dict[str, WorkerStatus], switches: dict[str, RoleSwitch],
                 drained: set[str]) -> None:
    """Raise SwitchRefused if `worker_id` may not flip to `to` now. `drained`: the workers an operator drained."""
    reg = workers[worker_id].registration
    if reg.role is to:
        raise SwitchRefused("same_role", f"worker {worker_id} is a {to.value} already")
    flipping = sorted(wid for wid, switch in switches.items() if running(switch) and wid in workers)
    if flipping:
        raise SwitchRefused("switch_running", f"a flip is running already (worker {flipping[0]}): one at a time, "
                                              f"so that each sees the pools the last one left")
    if not reg.switch_enabled:
        # A KV store is the usual cause (pdcluster/worker/switching.py): name it, the operator's next question.
        why = (": it keeps a kv_store, whose pages SGLang would delete at a flip" if reg.kv_store is not None else
               " (cluster.role_switch false, or a backend that cannot)")
        raise SwitchRefused("not_switch_enabled", f"worker {worker_id} was not started switch-enabled (its SGLang "
                                                  f"runs without --enable-pd-role-switch){why}")
    backend = reg.identity.transfer_backend
    if backend not in SWITCHABLE_BACKENDS:
        raise SwitchRefused("backend_cannot", f"transfer backend {backend} cannot switch roles (only Mooncake's can)")
    others = [wid for wid, status in workers.items() if wid != worker_id and status.registration.role is reg.role
              and status.healthy and wid not in drained]
    if not others:
        raise SwitchRefused("last_of_role", f"worker {worker_id} is the last serving {reg.role.value}: the cluster "
                                            f"would have none left")


def begin(to: Role) -> RoleSwitch:
    return RoleSwitch(to=to, state="draining", started=time.time())


def advanced(switch: RoleSwitch, state: str, reason: str = "") -> RoleSwitch:
    """`switch` moved on to `state` (a running flip only moves forward; an ended one stays as it ended)."""
    if not running(switch) or state == switch.state:
        return switch
    now = time.time()
    update: dict = {"state": state, "reason": reason or switch.reason}
    if state == "switching":
        update["switching_at"] = now
    else:
        update["ended"] = now
        if switch.switching_at is None and state == "done":
            update["switching_at"] = now
    return switch.model_copy(update=update)


def overdue(switch: RoleSwitch, now: float) -> bool:
    return running(switch) and now - switch.started > SWITCH_DEADLINE
