"""SGLang plugin: a worker whose KV-transfer thread died ends, so its launcher restarts it, instead of serving on.

Why: SGLang's Mooncake connection hands KV over on threads of the scheduler process (prefill: one `transfer_worker`
per transfer queue; decode: its bootstrap and heartbeat threads). When one of them raises, SGLang logs "Transfer
thread failed ... Prefill instance with bootstrap_port=... is dead" and the thread is gone, but nothing ends the
process: its HTTP server, scheduler and /health go on, so the router keeps pairing it, and every request whose
transfer lands on the dead thread's queue waits out the decode's bootstrap timeout (60 s) and fails. Seen in CI with
SGLang 0.5.23: the transfer worker's clean-up tests `room not in request_status` and then reads
`request_status[room]`, while the scheduler thread clears a concluded room in between (a KeyError; upstream reports
the same family, kvcache-ai/Mooncake#1400). The prefill served 8 minutes as a zombie.

What: with PDCLUSTER_THREAD_GUARD=1 (the launcher sets it for both roles, on CPU and GPU alike: this is supervision,
not a CPU adaptation), an exception that ends a thread while running code of `sglang.srt.disaggregation` sends SIGQUIT
to SGLang's main process, as SGLang's own scheduler does when it crashes: the main process kills its tree, the
launcher sees SGLang exit and deregisters, and whatever restarts launchers (compose, the local launcher, Kubernetes)
starts it again. The requests it held fail at once instead of after 60 s. Nothing of SGLang is patched: Python's
`threading.excepthook` is chained (the thread's traceback is still printed first).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger(__name__)

ENV_VAR = "PDCLUSTER_THREAD_GUARD"
WATCHED_PACKAGE = "sglang.srt.disaggregation"


def watched_dir() -> str:
    """Where the code whose threads are guarded lives; no such package means SGLang changed and the guard refuses."""
    spec = importlib.util.find_spec(WATCHED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"pdcluster thread_guard ({ENV_VAR}=1): SGLang has no package {WATCHED_PACKAGE}; the guard "
                         "cannot tell its KV-transfer threads. Unset the variable or pin the SGLang this was made for.")
    return os.path.join(os.path.realpath(next(iter(spec.submodule_search_locations))), "")


def raised_in(tb: TracebackType | None, directory: str) -> bool:
    return any(os.path.realpath(frame.filename).startswith(directory) for frame in traceback.extract_tb(tb))


def end_sglang() -> None:
    """SIGQUIT to SGLang's main process: its handler kills its whole tree (SGLang's own way for a failed child).
    The launcher starts SGLang in a session of its own, so the main process leads this process group. When the
    leader is not SGLang (someone set the variable by hand), the outermost SGLang process above this one (or this
    one) is told: never a shell or a supervisor that is not SGLang's."""
    import psutil  # SGLang's own dependency

    def is_sglang(pid: int) -> bool:  # False for a process that is gone, the group's leader included
        with contextlib.suppress(psutil.Error):
            return "sglang" in " ".join(psutil.Process(pid).cmdline())
        return False

    def parent_of(pid: int) -> int:  # 0 when there is none (or it is gone)
        with contextlib.suppress(psutil.Error):
            return psutil.Process(pid).ppid()
        return 0

    target = os.getpgrp()  # its leader may be gone (a shell that started SGLang in the background and ended)
    if not is_sglang(target):
        target = os.getpid()
        while (parent := parent_of(target)) and is_sglang(parent):
            target = parent
    os.kill(target, signal.SIGQUIT)


def guard(previous: Callable[[threading.ExceptHookArgs], object], directory: str,
          end: Callable[[], None] = end_sglang) -> Callable[[threading.ExceptHookArgs], None]:
    def hook(args: threading.ExceptHookArgs) -> None:
        previous(args)
        if args.exc_type is SystemExit or not raised_in(args.exc_traceback, directory):
            return
        name = args.thread.name if args.thread is not None else "?"
        logger.error("pdcluster thread_guard: SGLang's KV-transfer thread %s died (%s: %s); this worker can no longer "
                     "hand KV over, so it ends now and its launcher restarts it", name, args.exc_type.__name__,
                     args.exc_value)
        end()

    hook.pdcluster_guard = True  # type: ignore[attr-defined]
    return hook


def register() -> None:
    """The `sglang.srt.plugins` entry point (called in SGLang's main process and in each of its children)."""
    if os.environ.get(ENV_VAR) != "1" or getattr(threading.excepthook, "pdcluster_guard", False):
        return
    threading.excepthook = guard(threading.excepthook, watched_dir())
