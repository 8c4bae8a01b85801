"""The internals the idle-yield plugin relies on, checked first: SGLang 0.5.23's `Scheduler.on_idle` (wrapped) and
`Scheduler.is_fully_idle` (what tells the spinning branch from the sleeping one), by fingerprint; and the wrapper."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, NoReturn, cast

from pdcluster.plugins.cpu_idle_yield import PLUGIN
from pdcluster.plugins.sglang_plugin import fingerprint, import_module

MODULE, CLASS = "sglang.srt.managers.scheduler", "Scheduler"
# sha256 of ast.dump of each method without its docstring, as SGLang 0.5.23 ships it.
FINGERPRINTS = {
    "on_idle": "1dc29def553de8de19f35e114bbbda5539dfb4edf0d962a03c85a47d5b93aaf3",
    "is_fully_idle": "992978cdd8786dab877481cf83d99d51c05a274faef0d2e3f95d21c156c5a0d9",
}
WRITTEN_FOR = "0.5.23"
WAIT_MS = 1  # how long a scheduler with only hand-offs pending waits before it polls them again


def _fail(what: str) -> NoReturn:
    PLUGIN.refuse(what, WRITTEN_FOR, ", or unset the variable")


def waiting(on_idle: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`on_idle`, then, if the scheduler is still not fully idle (the branch that only yielded the GIL), a wait of
    WAIT_MS on its idle poller (woken by a request), or a sleep of as long without one."""

    @functools.wraps(on_idle)
    def wrapper(self: Any) -> Any:
        result = on_idle(self)
        if not self.is_fully_idle():
            sleeper = getattr(self, "idle_sleeper", None)
            if sleeper is not None:
                sleeper.poller.poll(WAIT_MS)
            else:
                time.sleep(WAIT_MS / 1000)
        return result

    wrapper.pdcluster_wrapped = on_idle  # type: ignore[attr-defined]
    return wrapper


def apply() -> list[str]:
    cls = getattr(import_module(MODULE, _fail), CLASS, None)
    if cls is None:
        _fail(f"{MODULE}.{CLASS} is missing")
    current = {name: getattr(cls, name, None) for name in FINGERPRINTS}
    for name, method in current.items():
        if method is None:
            _fail(f"{MODULE}.{CLASS}.{name} is missing")
    on_idle = cast(Callable[[Any], Any], current["on_idle"])  # present: checked just above
    if getattr(on_idle, "pdcluster_wrapped", None) is not None:
        return []  # SGLang loads plugins again in each child it forks
    for name, method in current.items():
        if fingerprint(method) != FINGERPRINTS[name]:
            _fail(f"{CLASS}.{name} has changed (fingerprint {fingerprint(method)})")
    cls.on_idle = waiting(on_idle)
    return [f"{MODULE}.{CLASS}.on_idle"]
