"""What the launchers of child processes share (the worker launcher for SGLang, the router for its processes):
children that die with their parent, and exit statuses in the shell's convention."""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; a no-op elsewhere)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def exit_status(returncode: int) -> int:
    """Shell convention: a child killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode
