"""The CPU HiCache plugin (pdcluster/plugins/cpu_hicache): its torch transfer ops against a plain reference, its gating,
its refusal when an SGLang internal it adapts has changed, and SGLang's own host pool moving KV through it."""

import ast
import importlib.util
import inspect
import types
from pathlib import Path

import pytest
import torch

import pdcluster.plugins.cpu_hicache as plugin
from pdcluster.plugins.cpu_hicache import internals, ops
from tests.helpers import assert_plugin_refuses

PAGE_SIZES = [1, 2, 16, 64]
HEADS, DIM = 2, 4


def indices(pattern, pages, page_size, total_pages, gen):
    """Token slots of `pages` whole pages: contiguous from page 1, or random distinct pages in random order."""
    if pattern == "contiguous":
        chosen = torch.arange(1, pages + 1)
    else:
        chosen = torch.randperm(total_pages, generator=gen)[:pages]
    return (chosen[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def layers(n, tokens, gen):
    return [torch.randn(tokens, HEADS, DIM, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("pattern", ["contiguous", "random"])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_direct_copies_token_rows_of_every_layer(page_size, pattern, num_layers):
    gen = torch.Generator().manual_seed(page_size * 7 + num_layers)
    pages, total = 5, 12
    src, dst = layers(2 * num_layers, total * page_size, gen), layers(2 * num_layers, total * page_size, gen)
    before = [t.clone() for t in dst]
    s_idx, d_idx = indices(pattern, pages, page_size, total, gen), indices("random", pages, page_size, total, gen)
    ops.transfer_kv_direct(src_layers=src, dst_layers=dst, src_indices=s_idx, dst_indices=d_idx, page_size=page_size)
    for j in range(2 * num_layers):
        want = before[j].clone()
        for s, d in zip(s_idx.tolist(), d_idx.tolist(), strict=True):
            want[d] = src[j][s]
        assert torch.equal(dst[j], want)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("pattern", ["contiguous", "random"])
@pytest.mark.parametrize("num_layers", [1, 4])
@pytest.mark.parametrize("components", [2, 1])  # K and V (MHA), or one latent buffer (MLA)
def test_page_first_direct_both_ways(page_size, pattern, num_layers, components):
    gen = torch.Generator().manual_seed(page_size * 13 + num_layers * 3 + components)
    pages, total = 4, 10
    host = [torch.randn(total, num_layers, page_size, HEADS, DIM, generator=gen) for _ in range(components)]
    host_before = [t.clone() for t in host]
    device = layers(components * num_layers, total * page_size, gen)  # component-major: K layers then V layers
    device_before = [t.clone() for t in device]
    h_idx, d_idx = indices(pattern, pages, page_size, total, gen), indices("random", pages, page_size, total, gen)

    ops.transfer_kv_all_layer_direct_lf_pf(src_ptrs=device, dst_ptrs=host, src_indices=d_idx, dst_indices=h_idx,
                                           page_size=page_size)
    for c in range(components):
        want = host_before[c].clone()
        for i in range(pages):
            hp, d = h_idx[i * page_size].item() // page_size, d_idx[i * page_size].item()
            for j in range(num_layers):
                for t in range(page_size):
                    want[hp, j, t] = device[c * num_layers + j][d + t]
        assert torch.equal(host[c], want)

    layer_id = num_layers - 1  # per-layer load of one layer into fresh device tensors, from the original host data
    fresh = layers(components, total * page_size, gen)
    fresh_before = [t.clone() for t in fresh]
    ops.transfer_kv_per_layer_direct_pf_lf(src_ptrs=host_before, dst_ptrs=fresh, src_indices=h_idx,
                                           dst_indices=d_idx, layer_id=layer_id, page_size=page_size)
    for c in range(components):
        want = fresh_before[c].clone()
        for i in range(pages):
            hp, d = h_idx[i * page_size].item() // page_size, d_idx[i * page_size].item()
            for t in range(page_size):
                want[d + t] = host_before[c][hp, layer_id, t]
        assert torch.equal(fresh[c], want)
    assert all(torch.equal(a, b) for a, b in zip(device, device_before, strict=True))  # sources untouched


def test_ops_take_sgl_kernels_parameters_and_reject_bad_shapes():
    # Read, not imported: the installed sgl_kernel cannot load without a CUDA driver.
    spec = importlib.util.find_spec("sgl_kernel")
    source = Path(spec.origin).parent / "kvcacheio.py" if spec and spec.origin else None
    # The pinned sgl_kernel ships it: its absence means the kernel package changed, which is what this test guards.
    assert source is not None and source.exists(), "the installed sgl_kernel has no kvcacheio.py source"
    tree = ast.parse(source.read_text())
    kernel = {f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)}
    for name in internals.OPS:
        assert list(inspect.signature(getattr(ops, name)).parameters) == kernel[name]
    t = [torch.zeros(8, HEADS, DIM)]
    with pytest.raises(ValueError, match="differ in length"):
        ops.transfer_kv_direct(t, t, torch.arange(4), torch.arange(2), 2)
    with pytest.raises(ValueError, match="whole number of pages"):
        ops.transfer_kv_direct(t, t, torch.arange(3), torch.arange(3), 2)


# --- the plugin against the installed SGLang ---------------------------------------------------------------------

# On a CUDA machine the plugin is a no-op by design (its no-op tests run there); CI has no GPU.
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(),  # skip-ok: GPU only
                               reason="the adaptation is for machines without CUDA")


@pytest.fixture
def sglang_mods():
    import sglang.srt.managers.cache_controller as controller
    import sglang.srt.mem_cache.pool_host.base as base
    import sglang.srt.mem_cache.pool_host.mha as mha

    originals = (base.HostKVCache.__init__, controller.HiCacheController.__init__,
                 base.HICACHE_HOST_MEMORY_RESERVE_BYTES)
    yield types.SimpleNamespace(base=base, mha=mha, controller=controller)
    internals.undo()
    assert (base.HostKVCache.__init__, controller.HiCacheController.__init__,
            base.HICACHE_HOST_MEMORY_RESERVE_BYTES) == originals
    assert not any(hasattr(mha, op) for op in internals.OPS)


def untouched(m):
    return not internals._undo and not any(hasattr(m.mha, op) for op in internals.OPS) and not hasattr(
        m.base.HostKVCache.__init__, "__wrapped__")


@pytest.mark.parametrize("value", [None, "0", "", "true"])
def test_no_op_unless_env_is_1(sglang_mods, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV_VAR, value)
    plugin.register()
    assert untouched(sglang_mods)


def test_no_op_when_torch_sees_cuda(sglang_mods, monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugin.register()
    assert untouched(sglang_mods)


@needs_cpu
def test_register_patches_and_is_idempotent(sglang_mods, monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    plugin.register()
    assert sglang_mods.mha.transfer_kv_direct is ops.transfer_kv_direct
    assert sglang_mods.base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 1 << 30
    assert len(internals._undo) == 3 + len(internals.OPS)


@needs_cpu
def test_host_pool_budget_keeps_back_one_gib_not_ten(sglang_mods, monkeypatch):
    """A pool that fits in free RAM minus 1 GiB is allowed, though free RAM is under SGLang's 10 GiB reserve."""
    base = sglang_mods.base
    monkeypatch.setattr(base, "available_host_memory_bytes", lambda **kwargs: 4 << 30)
    monkeypatch.setattr(base, "ranks_per_host", lambda: 1)
    assert base.host_memory_budget_bytes(1 << 30) < 0  # stock SGLang: 4 GiB free is "-6 GiB available"
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    assert base.host_memory_budget_bytes(1 << 30) == 3 << 30


def _refuse_helper(self, *args, **kwargs):  # a reshaped transfer method that no longer calls the ops
    return None


CHANGES = {
    "HostKVCache": lambda m, mp: mp.delattr(m.base, "HostKVCache"),
    "pin_memory": lambda m, mp: mp.setattr(m.base.HostKVCache, "__init__", lambda self, *, dtype, pinned: None),
    "load_to_device_per_layer": lambda m, mp: mp.setattr(m.mha.MHATokenToKVPoolHost, "load_to_device_per_layer",
                                                         _refuse_helper),
    "transfer_kv_direct is already bound": lambda m, mp: mp.setattr(m.mha, "transfer_kv_direct", print,
                                                                    raising=False),
    "io_backend": lambda m, mp: mp.setattr(m.controller.HiCacheController, "__init__", lambda self, mem_pool_host: 0),
    "HICACHE_HOST_MEMORY_RESERVE_BYTES": lambda m, mp: mp.delattr(m.base, "HICACHE_HOST_MEMORY_RESERVE_BYTES"),
    "get_dummy_flat_data_page": lambda m, mp: mp.setattr(m.mha.MHATokenToKVPoolHost, "get_dummy_flat_data_page",
                                                         lambda self: torch.zeros(1, pin_memory=True)),
}


@needs_cpu
@pytest.mark.parametrize("change", CHANGES)
def test_refuses_at_load_naming_the_changed_internal(sglang_mods, monkeypatch, change):
    CHANGES[change](sglang_mods, monkeypatch)
    assert_plugin_refuses(plugin, internals, monkeypatch, change)


@needs_cpu
@pytest.mark.parametrize("io_backend, layout", [("kernel", "layer_first"), ("direct", "page_first"),
                                                ("direct", "page_head")])
def test_controller_refuses_what_the_torch_ops_cannot_serve(sglang_mods, io_backend, layout):
    internals.apply()
    with pytest.raises(ValueError, match="needs --hicache-io-backend direct"):
        sglang_mods.controller.HiCacheController(
            token_to_kv_pool_allocator=None, mem_pool_host=types.SimpleNamespace(layout=layout), page_size=1,
            tp_group=None, load_cache_event=None, io_backend=io_backend)


@needs_cpu
@pytest.mark.parametrize("layout", internals.LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_host_pool_round_trip(sglang_mods, layout, page_size):
    """SGLang's own MHA host pool, built with its default pin_memory=True, backs up and reloads KV through the ops."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    internals.apply()
    num_layers, gen = 3, torch.Generator().manual_seed(page_size)
    kv = MHATokenToKVPool(32 * page_size, page_size, torch.float32, HEADS, DIM, num_layers, "cpu", False,
                          start_layer=0, end_layer=num_layers)
    host = sglang_mods.mha.MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout, device_capacity_tokens=kv.size,
        start_layer=0, end_layer=num_layers)
    assert host.pin_memory is False and not host.kv_buffer.is_pinned()
    assert not host.get_dummy_flat_data_page().is_pinned()  # the file backend's read buffer
    for t in (*kv.k_buffer, *kv.v_buffer):
        t.copy_(torch.randn(t.shape, generator=gen))
    dev = indices("random", 5, page_size, 30, gen)
    hst = indices("random", 5, page_size, 60, gen)
    want = [t[dev].clone() for t in (*kv.k_buffer, *kv.v_buffer)]
    host.backup_from_device_all_layer(kv, hst, dev, "direct")
    for t in (*kv.k_buffer, *kv.v_buffer):
        t.zero_()
    dev2 = indices("random", 5, page_size, 30, gen)
    for layer in range(num_layers):
        host.load_to_device_per_layer(kv, hst, dev2, layer, "direct")
    assert all(torch.equal(t[dev2], w) for t, w in zip((*kv.k_buffer, *kv.v_buffer), want, strict=True))
