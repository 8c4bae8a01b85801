"""The one internal the flipped-prefill plugin wraps, checked first: SGLang 0.5.23's
`CommonKVReceiver._setup_bootstrap_infos` (its code by fingerprint), and the wrapper itself."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from pdcluster.plugins.sglang_plugin import import_module, sglang_version, wrap_once

MODULE, CLASS, METHOD = "sglang.srt.disaggregation.common.conn", "CommonKVReceiver", "_setup_bootstrap_infos"
# sha256 of ast.dump of the method without its docstring, as SGLang 0.5.23 ships it.
FINGERPRINT = "95c7bcdc417b85c4dbea5dc2b472bb34dd7275e497d913c8049a4e040e2318b6"
WRITTEN_FOR = "0.5.23"
REVALIDATE_AFTER = 0.5  # seconds; under ROUTERS_FOLLOW, the least a flip takes after the prefill's last request
logger = logging.getLogger(__name__)


def _fail(what: str) -> NoReturn:
    raise SystemExit(
        f"pdcluster flipped_prefill (PDCLUSTER_FLIPPED_PREFILL=1) cannot adapt SGLang {sglang_version()}: {what}. It "
        f"was written for SGLang {WRITTEN_FOR}; re-check pdcluster/plugins/flipped_prefill against this version (the "
        "flip may be handled there), or unset the variable")


def addresses(infos: Iterable[dict]) -> set[tuple[Any, Any]]:
    return {(info.get("rank_ip"), info.get("rank_port")) for info in infos}


def keys(receiver: Any) -> list[tuple[str, int]]:
    """The connection-pool keys this request uses (as SGLang builds them), each with its CP rank."""
    return [(f"{receiver.bootstrap_addr}_{receiver.prefill_dp_rank}_{cp_rank}_{receiver.target_tp_rank}", cp_rank)
            for cp_rank in receiver.target_cp_ranks]


def stale_keys(receiver: Any, now: float, checked: dict[str, float]) -> list[str]:
    """The receiver's cached entries whose prefill now answers with another rank address, asked for each entry not
    found current (or filled) within REVALIDATE_AFTER."""
    stale = []
    for key, cp_rank in keys(receiver):
        with receiver.kv_mgr.connection_lock:
            cached = receiver.kv_mgr.connection_pool.get(key)
        if cached is None or now - checked.get(key, float("-inf")) < REVALIDATE_AFTER:
            continue
        checked[key] = now
        current = [receiver._get_bootstrap_info_from_server(receiver.prefill_dp_rank, cp_rank, tp_rank, pp_rank)
                   for tp_rank in receiver.target_tp_ranks for pp_rank in receiver.target_pp_ranks]
        if any(info is None for info in current):
            continue  # the prefill does not answer: SGLang's own heartbeat deals with a prefill that is gone
        if addresses(current) != addresses(cached):
            stale.append(key)
    return stale


def revalidating(setup: Callable[..., Any]) -> Callable[..., Any]:
    """`setup` after dropping the receiver's stale cached entries (SGLang then connects and registers anew)."""
    checked: dict[str, float] = {}  # bootstrap key -> when its entry was last found current (this process's)
    lock = threading.Lock()

    @functools.wraps(setup)
    def _setup_bootstrap_infos(self: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            stale = stale_keys(self, time.monotonic(), checked)
        for key in stale:
            with self.kv_mgr.connection_lock:
                self.kv_mgr.connection_pool.pop(key, None)
            logger.warning("pdcluster flipped_prefill: the prefill at %s was flipped (its KV manager moved): "
                           "connecting anew", self.bootstrap_addr)
        answer = setup(self, *args, **kwargs)
        with lock:  # what SGLang filled just now is current
            now = time.monotonic()
            for key, _ in keys(self):
                if (key not in checked or key in stale) and key in self.kv_mgr.connection_pool:
                    checked[key] = now
        return answer

    _setup_bootstrap_infos.pdcluster_wrapped = setup  # type: ignore[attr-defined]
    return _setup_bootstrap_infos


def apply() -> list[str]:
    cls = getattr(import_module(MODULE, _fail), CLASS, None)
    if not callable(getattr(cls, "_get_bootstrap_info_from_server", None)):  # what the wrapper asks the prefill with
        _fail(f"{MODULE}.{CLASS}._get_bootstrap_info_from_server is missing")
    patched = wrap_once(cls, METHOD, FINGERPRINT, revalidating, _fail, f"{MODULE}.{CLASS}.{METHOD}")
    if patched:
        logger.info("pdcluster flipped_prefill active: patched %s", patched[0])
    return patched
