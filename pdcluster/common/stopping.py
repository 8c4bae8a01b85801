"""A command that runs until it is asked to stop (the local cluster, the planner): SIGINT or SIGTERM only sets a flag,
which the command's main loop reads, so that the loop, not a signal handler, stops what the command started."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


def stop_requested() -> Callable[[], bool]:
    """Handles SIGINT and SIGTERM from now on (call it from the main thread); the answer says whether either came."""
    stopped = threading.Event()

    def on_signal(_sig: int, _frame: object) -> None:
        stopped.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stopped.is_set
