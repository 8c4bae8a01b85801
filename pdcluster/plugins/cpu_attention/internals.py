"""The internals the CPU attention adaptation replaces or relies on: checked as a whole first, then patched.

Written against SGLang 0.5.23 and its torch 2.14. The methods replaced, `TorchNativeAttnBackend`'s
`_run_sdpa_forward_extend` and `_run_sdpa_forward_decode`, are compared by a fingerprint of their code (comments,
formatting and docstring aside): any change to one, a fix included, stops the server at start with its name, rather
than being overridden unseen. Their callers must still call them, and the torch op the extend uses must still take and
return what it did.
"""

from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Any, NoReturn

from pdcluster.plugins.cpu_attention import PLUGIN, ops
from pdcluster.plugins.sglang_plugin import fingerprint, import_module

BACKEND = "sglang.srt.layers.attention.torch_native_backend"
CLASS = "TorchNativeAttnBackend"
METHOD, DECODE = "_run_sdpa_forward_extend", "_run_sdpa_forward_decode"
_HEAD = ("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens")
_TAIL = ("encoder_lens", "scaling", "enable_gqa", "causal", "is_cross_attn", "sliding_window_size")
# Each method: its caller, its parameters, and the sha256 of ast.dump of its code without the docstring, as SGLang
# 0.5.23 ships it (fingerprint() computes it).
METHODS = {
    METHOD: ("forward_extend", (*_HEAD, "extend_prefix_lens", "extend_seq_lens", *_TAIL),
             "cc789a748995a274f8e3e3d98853ab29a6d9f9f8ed344da3250b8a087d9a6dbd"),
    DECODE: ("forward_decode", (*_HEAD, *_TAIL), "713e4ea006d6f7ec9f5510acc585913433731349213c3ecef455cb33939e8cf8"),
}
FLASH_ARGUMENTS = ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale")
FLASH_RETURNS = 2  # (output, logsumexp)
WRITTEN_FOR = "0.5.23"
_MISSING = object()
_undo: list[tuple[Any, str, Any]] = []
logger = logging.getLogger(__name__)


def _fail(what: str) -> NoReturn:
    PLUGIN.refuse(what, WRITTEN_FOR,
                  ", or turn it off (cluster.cpu_attention: false) to run SGLang's own CPU attention")


def _module(name: str) -> ModuleType:
    return import_module(name, _fail)


def _method(backend: type, name: str) -> Any:
    """SGLang's own `name` (also once apply() has wrapped it), checked: present, same parameters, same code, called."""
    where = f"{BACKEND}.{CLASS}.{name}"
    caller_name, parameters, expected = METHODS[name]
    method = vars(backend).get(name, _MISSING)
    if method is _MISSING or not inspect.isfunction(method):
        _fail(f"{where} is missing or not a plain method")
    method = inspect.unwrap(method)
    if tuple(inspect.signature(method).parameters) != parameters:
        _fail(f"{where} no longer takes ({', '.join(parameters)})")
    try:
        found = fingerprint(method)
    except (OSError, TypeError, SyntaxError) as exc:
        _fail(f"the source of {where} cannot be read ({exc})")
    if found != expected:
        _fail(f"{where} has changed (its code's fingerprint is {found[:12]}, not {expected[:12]})")
    calling = getattr(backend, caller_name, None)
    caller = getattr(inspect.unwrap(calling), "__code__", None) if calling is not None else None
    if caller is None or name not in caller.co_names:
        _fail(f"{BACKEND}.{CLASS}.{caller_name} no longer calls {name}")
    return method


def check() -> dict[str, Any]:
    """Verify every internal the adaptation touches; return them (the backend, SGLang's own "extend" and "decode").
    Patches nothing."""
    backend = getattr(_module(BACKEND), CLASS, _MISSING)
    if not isinstance(backend, type):
        _fail(f"{BACKEND}.{CLASS} is missing")
    found = {"backend": backend, "extend": _method(backend, METHOD), "decode": _method(backend, DECODE)}
    import torch

    op = getattr(getattr(torch.ops.aten, ops.FLASH_OP, None), "default", None)
    schema = getattr(op, "_schema", None)
    if schema is None:
        _fail(f"torch {torch.__version__} has no op aten.{ops.FLASH_OP}")
    if (tuple(a.name for a in schema.arguments) != FLASH_ARGUMENTS or len(schema.returns) != FLASH_RETURNS):
        _fail(f"torch {torch.__version__}'s aten.{ops.FLASH_OP} no longer takes ({', '.join(FLASH_ARGUMENTS)}) and "
              "returns (output, logsumexp)")
    return found


def _set(owner: Any, name: str, value: Any) -> None:
    _undo.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def _fallback_reason(causal, encoder_lens, is_cross_attn, sliding_window_size, want_causal=True) -> str | None:
    if causal != want_causal:
        return "non-causal attention" if want_causal else "causal decode attention"
    if is_cross_attn or encoder_lens is not None:
        return "cross attention or encoder lengths"
    if sliding_window_size is not None and sliding_window_size > -1:
        return "a sliding window"
    return None


def _fallen_back(logged: set[str], kind: str, reason: str) -> None:
    if reason not in logged:  # once per reason and process: what SGLang's own attention still computes
        logged.add(reason)
        logger.warning("pdcluster cpu_attention: SGLang's own %s attention for %s", kind, reason)


def _extend(original: Any, logged: set[str]) -> Any:
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
        _fallen_back(logged, "extend", reason)
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                        is_cross_attn, sliding_window_size)

    return run_sdpa_forward_extend


def _decode(original: Any, logged: set[str]) -> Any:
    @functools.wraps(original)
    def run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                sliding_window_size=None):
        reason = _fallback_reason(causal, encoder_lens, is_cross_attn, sliding_window_size, want_causal=False)
        if reason is None and not ops.covers_decode(query, k_cache, v_cache, seq_lens):
            reason = "a batch not of one query per non-empty sequence, or of other head counts or sizes"
        if reason is None:
            return ops.decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling)
        _fallen_back(logged, "decode", reason)
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)

    return run_sdpa_forward_decode


def apply() -> list[str]:
    """Check, then patch; idempotent. Returns what was patched (for the log)."""
    found = check()
    if _undo:
        return []
    logged: set[str] = set()
    _set(found["backend"], METHOD, _extend(found["extend"], logged))
    _set(found["backend"], DECODE, _decode(found["decode"], logged))
    return [f"{BACKEND}.{CLASS}.{METHOD} (new tokens' queries only)", f"{DECODE} (the batch in one call)"]


def undo() -> None:
    """Restore everything apply() changed (for tests)."""
    while _undo:
        owner, name, old = _undo.pop()
        delattr(owner, name) if old is _MISSING else setattr(owner, name, old)
