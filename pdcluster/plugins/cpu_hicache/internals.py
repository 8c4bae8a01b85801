"""The SGLang internals the CPU HiCache adaptation binds to: checked as a whole first, then patched.

Written against SGLang 0.5.23. Every check names the internal it expected, so an upgrade that moves or reshapes one
stops the server at start with that name instead of failing at the first transfer (or silently).
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any, NoReturn

from pdcluster.plugins.cpu_hicache import PLUGIN, ops
from pdcluster.plugins.sglang_plugin import import_module

BASE, MHA, CONTROLLER = ("sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.pool_host.mha",
                         "sglang.srt.managers.cache_controller")
OPS = ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")
# The transfer methods of the MHA host pool that call the ops above by their module-global names.
CALLERS = ("load_to_device_per_layer", "backup_from_device_all_layer")
LAYOUTS = ("layer_first", "page_first_direct")  # the layouts the direct ops serve
# SGLang keeps 10 GiB of host RAM out of every HiCache host pool's budget, sized for a GPU server whose RAM is
# otherwise idle. On CPU the device KV pool (mem-fraction-static) already lives in that same RAM, so the 10 GiB
# refused small pools on a 24 GB machine running a 2P+2D cluster ("only have -0.10 GB free"); 1 GiB keeps headroom.
RESERVE, CPU_RESERVE_BYTES = "HICACHE_HOST_MEMORY_RESERVE_BYTES", 1 << 30
WRITTEN_FOR = "0.5.23"
_MISSING = object()
_undo: list[tuple[Any, str, Any]] = []


def _fail(what: str) -> NoReturn:
    PLUGIN.refuse(what, WRITTEN_FOR, ", or run HiCache on a GPU")


def _module(name: str) -> ModuleType:
    return import_module(name, _fail)


def _attr(owner: Any, name: str, where: str) -> Any:
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        _fail(f"{where}.{name} is missing")
    return value


def _params(fn: Any, where: str) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        _fail(f"{where} has no inspectable signature ({exc})")


def check() -> dict[str, Any]:
    """Verify every internal the adaptation touches; return them. Patches nothing."""
    base, mha, controller = _module(BASE), _module(MHA), _module(CONTROLLER)
    host_kv = _attr(base, "HostKVCache", BASE)
    pool = _check_host_pool(host_kv, mha)
    _check_transfer_ops(pool, mha)
    _check_reserve(base)
    hicache = _check_controller(controller)
    return {"base": base, "mha": mha, "HostKVCache": host_kv, "HiCacheController": hicache}


def _check_host_pool(host_kv: Any, mha: ModuleType) -> Any:
    """The host pools take pin_memory (set False on CPU), and the MHA pool, a HostKVCache, allocates with it."""
    pin = _params(_attr(host_kv, "__init__", f"{BASE}.HostKVCache"), f"{BASE}.HostKVCache.__init__").get("pin_memory")
    if pin is None or pin.kind is not inspect.Parameter.KEYWORD_ONLY:
        _fail(f"{BASE}.HostKVCache.__init__ no longer takes the keyword-only parameter pin_memory")
    pool = _attr(mha, "MHATokenToKVPoolHost", MHA)
    if not (isinstance(pool, type) and issubclass(pool, host_kv)):
        _fail(f"{MHA}.MHATokenToKVPoolHost is no longer a subclass of {BASE}.HostKVCache")
    dummy = _attr(pool, "get_dummy_flat_data_page", f"{MHA}.MHATokenToKVPoolHost")
    if "pin_memory" not in getattr(getattr(dummy, "__code__", None), "co_names", ()):  # the file backend's reads
        _fail(f"{MHA}.MHATokenToKVPoolHost.get_dummy_flat_data_page no longer allocates with self.pin_memory")
    return pool


def _check_transfer_ops(pool: Any, mha: ModuleType) -> None:
    """The pool's transfer methods call the ops by their module-global names, with sgl_kernel's keywords, and none is
    already bound to something else."""
    calls: set[str] = set()
    kwnames: set[frozenset] = set()
    for name in CALLERS:
        code = getattr(inspect.unwrap(_attr(pool, name, f"{MHA}.MHATokenToKVPoolHost")), "__code__", None)
        if code is None:
            _fail(f"{MHA}.MHATokenToKVPoolHost.{name} is not a plain function")
        calls.update(code.co_names)
        # Keyword names of each call, e.g. ('src_layers', ..., 'page_size'), are tuple constants of the code object.
        consts = [c for c in code.co_consts if isinstance(c, tuple)]
        kwnames.update(frozenset(c) for c in consts if all(isinstance(s, str) for s in c))
    for op in OPS:
        if op not in calls:
            _fail(f"{MHA}.MHATokenToKVPoolHost.{'/'.join(CALLERS)} no longer call {op}")
        if frozenset(inspect.signature(getattr(ops, op)).parameters) not in kwnames:
            _fail(f"{MHA} no longer calls {op} with the keyword arguments of sgl_kernel.kvcacheio.{op}")
        if getattr(mha, op, _MISSING) is not _MISSING and getattr(mha, op) is not getattr(ops, op):
            _fail(f"{MHA}.{op} is already bound on this machine without CUDA (0.5.23 binds it on CUDA/ROCm/XPU only)")


def _check_reserve(base: ModuleType) -> None:
    """The host memory reserve is an int that the budget reads."""
    if not isinstance(_attr(base, RESERVE, BASE), int):
        _fail(f"{BASE}.{RESERVE} is no longer an int")
    budget = _attr(base, "host_memory_budget_bytes", BASE)
    if RESERVE not in getattr(getattr(budget, "__code__", None), "co_names", ()):
        _fail(f"{BASE}.host_memory_budget_bytes no longer reads {RESERVE}")


def _check_controller(controller: ModuleType) -> Any:
    """HiCacheController takes the host pool and the io backend, which the direct-only check reads."""
    hicache = _attr(controller, "HiCacheController", CONTROLLER)
    init = _params(_attr(hicache, "__init__", f"{CONTROLLER}.HiCacheController"), f"{CONTROLLER}.HiCacheController")
    if not {"mem_pool_host", "io_backend"} <= init.keys():
        _fail(f"{CONTROLLER}.HiCacheController.__init__ no longer takes mem_pool_host and io_backend")
    return hicache


def _set(owner: Any, name: str, value: Any) -> None:
    _undo.append((owner, name, vars(owner).get(name, _MISSING)))  # a class's own attribute, or a module global
    setattr(owner, name, value)


def apply() -> list[str]:
    """Check, then patch; idempotent. Returns what was patched (for the log)."""
    found = check()
    if _undo:
        return []
    host_kv, hicache = found["HostKVCache"], found["HiCacheController"]
    pool_init, controller_init = host_kv.__init__, hicache.__init__
    controller_sig = inspect.signature(controller_init)

    @functools.wraps(pool_init)
    def host_pool_init(self, *args, **kwargs):
        kwargs["pin_memory"] = False  # plain RAM is the CPU's pinned memory; pinning needs a CUDA driver
        pool_init(self, *args, **kwargs)

    @functools.wraps(controller_init)
    def controller_init_direct_only(self, *args, **kwargs):
        bound = controller_sig.bind(self, *args, **kwargs).arguments
        io_backend, layout = bound.get("io_backend"), getattr(bound.get("mem_pool_host"), "layout", None)
        if io_backend != "direct" or (isinstance(layout, str) and layout not in LAYOUTS):
            raise ValueError(
                f"HiCache on CPU (pdcluster cpu_hicache) needs --hicache-io-backend direct and --hicache-mem-layout "
                f"{' or '.join(LAYOUTS)}; got io backend {io_backend!r}, layout {layout!r} (the kernel io backend "
                "takes CUDA pointer tables)")
        controller_init(self, *args, **kwargs)

    _set(host_kv, "__init__", host_pool_init)
    _set(hicache, "__init__", controller_init_direct_only)
    for op in OPS:
        _set(found["mha"], op, getattr(ops, op))
    reserve = min(getattr(found["base"], RESERVE), CPU_RESERVE_BYTES)
    _set(found["base"], RESERVE, reserve)
    return [f"{BASE}.HostKVCache.__init__ (pin_memory=False)", f"{CONTROLLER}.HiCacheController.__init__ (direct "
            "io only)", *(f"{MHA}.{op} (torch)" for op in OPS), f"{BASE}.{RESERVE} ({reserve >> 20} MiB)"]


def undo() -> None:
    """Restore everything apply() changed (for tests)."""
    while _undo:
        owner, name, old = _undo.pop()
        delattr(owner, name) if old is _MISSING else setattr(owner, name, old)
