"""The one internal the fork plugin wraps, checked first: SGLang 0.5.23's `_set_envs_and_config` (by fingerprint, as
pdcluster/plugins/cpu_transfer_race does), the function that forces `spawn` before SGLang starts its processes."""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable
from typing import Any, NoReturn

from pdcluster.plugins.cpu_fork import PLUGIN
from pdcluster.plugins.sglang_plugin import import_module, wrap_once

MODULE, FUNCTION = "sglang.srt.entrypoints.engine", "_set_envs_and_config"
# sha256 of ast.dump of the function without its docstring, as SGLang 0.5.23 ships it.
FINGERPRINT = "ab19a9a8f0ad3512778c51929435ccf027e459cd338269fb841c6728973cd210"
WRITTEN_FOR = "0.5.23"


def _fail(what: str) -> NoReturn:
    PLUGIN.refuse(what, WRITTEN_FOR, ", or unset the variable (SGLang then spawns)")


def forking(set_envs_and_config: Callable[..., Any]) -> Callable[..., Any]:
    """`set_envs_and_config`, then `fork` as the start method of the processes SGLang starts next."""

    @functools.wraps(set_envs_and_config)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = set_envs_and_config(*args, **kwargs)
        multiprocessing.set_start_method("fork", force=True)
        return result

    wrapped.pdcluster_wrapped = set_envs_and_config  # type: ignore[attr-defined]
    return wrapped


def apply() -> list[str]:
    return wrap_once(import_module(MODULE, _fail), FUNCTION, FINGERPRINT, forking, _fail, f"{MODULE}.{FUNCTION}")
