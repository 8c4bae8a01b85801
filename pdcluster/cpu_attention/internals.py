"""The internals the CPU attention adaptation replaces or relies on: checked as a whole first, then patched.

Written against SGLang 0.5.23 and its torch 2.14. The method replaced,
`TorchNativeAttnBackend._run_sdpa_forward_extend`, is compared by a fingerprint of its code (comments, formatting and
docstring aside): any change to it, a fix included, stops the server at start with its name, rather than being
overridden unseen. Its caller must still call it, and the torch op the replacement uses must still take and return what
it did.
"""

from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Any, NoReturn

from pdcluster.cpu_attention import ops
from pdcluster.sglang_plugin import fingerprint, import_module, refuse

BACKEND = "sglang.srt.layers.attention.torch_native_backend"
CLASS, METHOD, CALLER = "TorchNativeAttnBackend", "_run_sdpa_forward_extend", "forward_extend"
PARAMETERS = ("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens",
              "extend_prefix_lens", "extend_seq_lens", "encoder_lens", "scaling", "enable_gqa", "causal",
              "is_cross_attn", "sliding_window_size")
# sha256 of ast.dump of the method without its docstring, as SGLang 0.5.23 ships it (fingerprint() computes it).
FINGERPRINT = "cc789a748995a274f8e3e3d98853ab29a6d9f9f8ed344da3250b8a087d9a6dbd"
FLASH_ARGUMENTS = ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale")
FLASH_RETURNS = 2  # (output, logsumexp)
WRITTEN_FOR = "0.5.23"
_MISSING = object()
_undo: list[tuple[Any, str, Any]] = []
logger = logging.getLogger(__name__)


def _fail(what: str) -> NoReturn:
    refuse("cpu_attention", "PDCLUSTER_CPU_ATTENTION", what, WRITTEN_FOR,
           ", or turn it off (cluster.cpu_attention: false) to run SGLang's own CPU attention")


def _module(name: str) -> ModuleType:
    return import_module(name, _fail)


def check() -> dict[str, Any]:
    """Verify every internal the adaptation touches; return them. Patches nothing."""
    where = f"{BACKEND}.{CLASS}"
    backend = getattr(_module(BACKEND), CLASS, _MISSING)
    if not isinstance(backend, type):
        _fail(f"{where} is missing")
    method = vars(backend).get(METHOD, _MISSING)
    if method is _MISSING or not inspect.isfunction(method):
        _fail(f"{where}.{METHOD} is missing or not a plain method")
    method = inspect.unwrap(method)  # SGLang's own, also once apply() has wrapped it
    if tuple(inspect.signature(method).parameters) != PARAMETERS:
        _fail(f"{where}.{METHOD} no longer takes ({', '.join(PARAMETERS)})")
    try:
        found = fingerprint(method)
    except (OSError, TypeError, SyntaxError) as exc:
        _fail(f"the source of {where}.{METHOD} cannot be read ({exc})")
    if found != FINGERPRINT:
        _fail(f"{where}.{METHOD} has changed (its code's fingerprint is {found[:12]}, not {FINGERPRINT[:12]})")
    calling = getattr(backend, CALLER, None)
    caller = getattr(inspect.unwrap(calling), "__code__", None) if calling is not None else None
    if caller is None or METHOD not in caller.co_names:
        _fail(f"{where}.{CALLER} no longer calls {METHOD}")
    import torch

    op = getattr(getattr(torch.ops.aten, ops.FLASH_OP, None), "default", None)
    schema = getattr(op, "_schema", None)
    if schema is None:
        _fail(f"torch {torch.__version__} has no op aten.{ops.FLASH_OP}")
    if (tuple(a.name for a in schema.arguments) != FLASH_ARGUMENTS or len(schema.returns) != FLASH_RETURNS):
        _fail(f"torch {torch.__version__}'s aten.{ops.FLASH_OP} no longer takes ({', '.join(FLASH_ARGUMENTS)}) and "
              "returns (output, logsumexp)")
    return {"backend": backend, "method": method}


def _set(owner: Any, name: str, value: Any) -> None:
    _undo.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def _fallback_reason(causal, encoder_lens, is_cross_attn, sliding_window_size) -> str | None:
    if not causal:
        return "non-causal attention"
    if is_cross_attn or encoder_lens is not None:
        return "cross attention or encoder lengths"
    if sliding_window_size is not None and sliding_window_size > -1:
        return "a sliding window"
    return None


def apply() -> list[str]:
    """Check, then patch; idempotent. Returns what was patched (for the log)."""
    found = check()
    if _undo:
        return []
    original = found["method"]
    logged: set[str] = set()

    @functools.wraps(original)
    def run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        reason = _fallback_reason(causal, encoder_lens, is_cross_attn, sliding_window_size)
        if reason is None and not ops.covers(seq_lens, extend_prefix_lens, extend_seq_lens, query, v_cache):
            reason = "a batch whose sequences are not prefix + new tokens, or values of another head size"
        if reason is None:
            return ops.extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                              extend_prefix_lens, extend_seq_lens, scaling)
        if reason not in logged:  # once per reason and process: what SGLang's own attention still computes
            logged.add(reason)
            logger.warning("pdcluster cpu_attention: SGLang's own extend attention for %s", reason)
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                        is_cross_attn, sliding_window_size)

    _set(found["backend"], METHOD, run_sdpa_forward_extend)
    return [f"{BACKEND}.{CLASS}.{METHOD} (new tokens' queries only)"]


def undo() -> None:
    """Restore everything apply() changed (for tests)."""
    while _undo:
        owner, name, old = _undo.pop()
        delattr(owner, name) if old is _MISSING else setattr(owner, name, old)
