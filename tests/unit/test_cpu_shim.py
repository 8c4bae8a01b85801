import importlib.util

import pytest

from pdcluster.worker.environment import CPU_SHIM_DIR


def load_shim():
    spec = importlib.util.spec_from_file_location("sgl_kernel_shim", CPU_SHIM_DIR / "sgl_kernel" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_op_raises_an_error_naming_it():
    shim = load_shim()
    from_import = shim.copy_all_layer_kv_cache_cpu  # what `from sgl_kernel import x` does at module level
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        from_import(1, 2)
    with pytest.raises(NotImplementedError, match="silu_and_mul"):
        shim.silu_and_mul()


def test_dunder_lookups_are_not_faked():
    with pytest.raises(AttributeError):
        load_shim().__wrapped__  # noqa: B018 - introspection must not see a fake
