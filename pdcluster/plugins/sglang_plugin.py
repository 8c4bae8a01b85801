"""The one registration of pdcluster's CPU plugins (pdcluster/plugins/cpu_attention, cpu_fork, cpu_hicache,
cpu_idle_yield, cpu_seeded_sampling, cpu_transfer_race): each package's __init__ declares a `CpuPlugin` (its name, its
variable, what SGLang uses instead on CUDA) and exposes its `register`, the `sglang.srt.plugins` entry point; what it
adapts is in its internals.py. Shared here: when a plugin is on, how it recognises the SGLang code it adapts
(fingerprints), how it wraps a function once in a process (`wrap_once`), and how it refuses to start. SGLang's
load_plugins() calls each register() in the launcher and in every scheduler/detokenizer process; a plugin acts only when
its variable is 1 and torch sees no CUDA device."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import logging
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuPlugin:
    """One CPU plugin: `name`, its package (pdcluster/plugins/<name>, whose internals.py checks every SGLang internal
    it adapts, then patches them, in `apply() -> list[str]`, naming what it patched); `env_var`, the variable that turns
    it on (the worker launcher sets it for CPU workers); `on_cuda`, what SGLang uses instead on a CUDA device (logged
    when the variable is ignored there)."""

    name: str
    env_var: str
    on_cuda: str

    def active(self) -> bool:
        """Whether the plugin should adapt SGLang here: its variable is 1 and torch sees no CUDA device."""
        if os.environ.get(self.env_var) != "1":
            return False
        import torch

        if torch.cuda.is_available():
            logger.info("%s=1 ignored: torch sees a CUDA device, SGLang's own %s are used", self.env_var, self.on_cuda)
            return False
        return True

    def register(self) -> None:
        """The `sglang.srt.plugins` entry point: nothing unless active; then internals.apply() (imported only now:
        it imports SGLang's modules). It raises IncompatibleSGLang naming what changed, and load_plugins() logs and
        swallows an Exception from a plugin: SGLang would then start without the adaptation the config asked for
        (failing later and less clearly). So the refusal leaves as SystemExit, which it does not catch."""
        if not self.active():
            return
        internals = importlib.import_module(f"{__package__}.{self.name}.internals")
        try:
            patched = internals.apply()
        except IncompatibleSGLang as exc:
            raise SystemExit(str(exc)) from None
        if patched:
            logger.warning("pdcluster %s active (no CUDA): patched %s", self.name, ", ".join(patched))

    def refuse(self, what: str, written_for: str, instead: str) -> NoReturn:
        """The plugin's refusal, one wording for all: which plugin, what changed, the SGLang it was written for, and
        `instead` (what the operator can do, after "against this version")."""
        raise IncompatibleSGLang(
            f"pdcluster {self.name} ({self.env_var}=1) cannot adapt SGLang {sglang_version()}: {what}. It was written "
            f"for SGLang {written_for}; re-check pdcluster/plugins/{self.name} against this version{instead}")


class IncompatibleSGLang(RuntimeError):
    """An SGLang internal a plugin adapts is missing or has changed: the plugin refuses to start."""


def fingerprint(fn: Any) -> str:
    """sha256 of the function's syntax tree, docstring left out: comments and formatting do not change it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    if not isinstance(tree, ast.FunctionDef | ast.AsyncFunctionDef):
        raise TypeError(f"{fn!r} is not a function")
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        tree.body = body[1:]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def sglang_version() -> str:
    try:
        return getattr(importlib.import_module("sglang"), "__version__", "unknown")
    except ImportError:
        return "unknown"


def import_module(name: str, fail: Callable[[str], NoReturn]) -> ModuleType:
    """SGLang's module `name`, or the plugin's own `fail` naming it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        fail(f"module {name} does not import ({exc})")


def wrap_once(owner: Any, name: str, expected: str, wrap: Callable[[Any], Any], fail: Callable[[str], NoReturn],
              where: str) -> list[str]:
    """Replaces SGLang's `owner.name` (a class's method, a module's function; `where` names it) by `wrap(it)`, once in
    a process: SGLang loads plugins again in each child it forks, and finds it wrapped (`pdcluster_wrapped`, which the
    wrapper sets to what it wraps). `fail` if it is missing or its fingerprint is not `expected`. What it patched, as
    an `apply()` returns it."""
    current = getattr(owner, name, None)
    if current is None:
        fail(f"{where} is missing")
    if getattr(current, "pdcluster_wrapped", None) is not None:
        return []
    if fingerprint(current) != expected:
        fail(f"{where} has changed (fingerprint {fingerprint(current)})")
    setattr(owner, name, wrap(current))
    return [where]
