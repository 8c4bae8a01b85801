"""What pdcluster's SGLang plugins (pdcluster/plugins/cpu_hicache, cpu_attention, cpu_transfer_race) share: when one is
on, how it recognises the SGLang code it adapts, and how it refuses to start. SGLang's load_plugins() calls each
plugin's register() in the launcher and in every scheduler/detokenizer process; a plugin acts only when its variable is
1 and torch sees no CUDA device."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import logging
import os
import textwrap
from collections.abc import Callable
from types import ModuleType
from typing import Any, NoReturn

logger = logging.getLogger(__name__)


def active(env_var: str, on_cuda: str) -> bool:
    """Whether the plugin behind `env_var` should adapt SGLang here (`on_cuda`: what SGLang uses instead, logged)."""
    if os.environ.get(env_var) != "1":
        return False
    import torch

    if torch.cuda.is_available():
        logger.info("%s=1 ignored: torch sees a CUDA device, SGLang's own %s are used", env_var, on_cuda)
        return False
    return True


def apply(name: str, patch: Callable[[], list[str]]) -> None:
    """Run a plugin's `patch` (it checks every internal it adapts first and raises IncompatibleSGLang naming what
    changed). load_plugins() logs and swallows an Exception from a plugin, and SGLang would then start without the
    adaptation the config asked for (failing later and less clearly): so it leaves as SystemExit, which it does not
    catch."""
    try:
        patched = patch()
    except IncompatibleSGLang as exc:
        raise SystemExit(str(exc)) from None
    if patched:
        logger.warning("pdcluster %s active (no CUDA): patched %s", name, ", ".join(patched))


class IncompatibleSGLang(RuntimeError):
    """An SGLang internal a plugin adapts is missing or has changed: the plugin refuses to start."""


def refuse(plugin: str, env_var: str, what: str, written_for: str, instead: str) -> NoReturn:
    """A plugin's refusal, one wording for all: which plugin, what changed, the SGLang it was written for, and
    `instead` (what the operator can do, after "against this version")."""
    raise IncompatibleSGLang(
        f"pdcluster {plugin} ({env_var}=1) cannot adapt SGLang {sglang_version()}: {what}. It was written for SGLang "
        f"{written_for}; re-check pdcluster/plugins/{plugin} against this version{instead}")


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
