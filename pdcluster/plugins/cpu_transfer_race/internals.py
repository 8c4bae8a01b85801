"""The one internal the transfer-race plugin wraps, checked first: SGLang 0.5.23's `MooncakeKVManager.transfer_worker`
(its code by fingerprint, as pdcluster/plugins/cpu_attention does), and the wrapper itself."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NoReturn

from pdcluster.plugins.cpu_transfer_race import PLUGIN
from pdcluster.plugins.sglang_plugin import import_module, sglang_version, wrap_once

MODULE, CLASS, METHOD = "sglang.srt.disaggregation.mooncake.conn", "MooncakeKVManager", "transfer_worker"
# sha256 of ast.dump of the method without its docstring, as SGLang 0.5.23 ships it.
FINGERPRINT = "5c65eb6ffb99387152c26175522efb0dc5cb109339a25c85b9970954cea438c1"
WRITTEN_FOR = "0.5.23"
logger = logging.getLogger(__name__)


def _fail(what: str) -> NoReturn:
    PLUGIN.refuse(what, WRITTEN_FOR, " (the race may be fixed there), or unset the variable")


def raced_room(exc: BaseException, request_status: Any) -> int | None:
    """The room of SGLang's clean-up race, if `exc` is the loop's end by it: a RuntimeError raised while handling a
    KeyError whose room is no longer in `request_status`. None for anything else."""
    cause = exc.__context__
    if not isinstance(exc, RuntimeError) or not isinstance(cause, KeyError) or len(cause.args) != 1:
        return None
    room = cause.args[0]
    if not isinstance(room, int) or room in request_status:
        return None
    return room


def surviving(loop: Callable[..., Any]) -> Callable[..., Any]:
    """`loop` run again after each end by the race; its return and any other exception pass through."""

    @functools.wraps(loop)
    def transfer_worker(self: Any, *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return loop(self, *args, **kwargs)
            except RuntimeError as exc:
                room = raced_room(exc, self.request_status)
                if room is None:
                    raise
                logger.warning("pdcluster cpu_transfer_race: room %s was cleared by the scheduler while this transfer "
                               "thread was reading it (SGLang %s's race); the thread goes on", room, sglang_version())

    transfer_worker.pdcluster_wrapped = loop  # type: ignore[attr-defined]
    return transfer_worker


def apply() -> list[str]:
    cls = getattr(import_module(MODULE, _fail), CLASS, None)
    return wrap_once(cls, METHOD, FINGERPRINT, surviving, _fail, f"{MODULE}.{CLASS}.{METHOD}")
