"""Stand-in for the `sgl_kernel` package on CPU-only machines.

SGLang imports `sgl_kernel` at module level even on its CPU engine, and the PyPI `sglang-kernel` build cannot load
without `libcuda.so.1`. The worker launcher puts this directory first on PYTHONPATH for CPU runs only. Every attribute
is a function that fails loudly, naming the op, so a model that really needs a kernel stops with a clear error
instead of computing garbage. Llama on the `torch_native` attention backend never calls any of them.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+pdcluster-cpu-stand-in"


class MissingKernelError(NotImplementedError):
    pass


def _missing(name: str):
    def op(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise MissingKernelError(
            f"sgl_kernel op '{name}' is not available on this CPU-only run (pdcluster's stand-in sgl_kernel); "
            "this model or option needs a GPU build of sglang-kernel"
        )

    op.__name__ = name
    op.__qualname__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _missing(name)
