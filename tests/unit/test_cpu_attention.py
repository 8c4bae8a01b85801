"""The CPU attention plugin (pdcluster/plugins/cpu_attention): its extend and decode ops against SGLang's own at random
shapes, prefix and sequence lengths and page sizes, SGLang's backend running through them, what they leave to SGLang,
its gating, and its refusal when an internal it relies on has changed."""

import random
import types

import pytest
import torch

import pdcluster.plugins.cpu_attention as plugin
from pdcluster.plugins.cpu_attention import internals, ops
from tests.helpers import assert_plugin_refuses

SEEDS = range(24)
PAGE_SIZES = (1, 16, 64)


def batch(seed: int, dtype=torch.float32):
    """A random extend batch as SGLang lays it out: 1-4 requests, each a cached prefix (0, page-aligned or not, up to
    all but one token) plus new tokens, their KV slots in pages scattered over the pool; MHA or GQA."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kv_heads = rng.choice((1, 2, 3))
    heads, dim, page = kv_heads * rng.choice((1, 2, 3)), rng.choice((16, 64)), PAGE_SIZES[seed % len(PAGE_SIZES)]
    lens = []
    for _ in range(rng.randint(1, 4)):
        new = rng.choice((1, 2, rng.randint(3, 300)))
        prefix = rng.choice((0, page * rng.randint(1, 6), rng.randint(1, 400)))
        lens.append((prefix, new))
    pages = [(p + n + page - 1) // page for p, n in lens]
    pool_pages = torch.randperm(sum(pages) + 8, generator=gen)
    req_to_token = torch.zeros(8, max(p + n for p, n in lens) + page, dtype=torch.int64)
    order = rng.sample(range(8), len(lens))  # requests sit in any row of req_to_token
    used = 0
    for row, (p, n), count in zip(order, lens, pages, strict=True):
        slots = (pool_pages[used:used + count, None] * page + torch.arange(page)).reshape(-1)
        req_to_token[row, :p + n] = slots[:p + n]
        used += count
    slots = (len(pool_pages) + 1) * page
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    tokens = sum(n for _, n in lens)
    query = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    args = dict(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, req_pool_indices=torch.tensor(order),
                seq_lens=torch.tensor([p + n for p, n in lens]), extend_prefix_lens=torch.tensor([p for p, _ in lens]),
                extend_seq_lens=torch.tensor([n for _, n in lens]))
    return query, args, lens, dim ** -0.5, heads != kv_heads


def sglang_own(query, args, scaling, gqa, **extra):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as Backend

    original = internals.check()["extend"]
    return original(object.__new__(Backend), query, torch.empty_like(query), **args, scaling=scaling,
                    enable_gqa=gqa, causal=extra.pop("causal", True), **extra)


@pytest.mark.parametrize("seed", SEEDS)
def test_extend_equals_sglangs_own(seed):
    query, args, lens, scaling, gqa = batch(seed)
    want = sglang_own(query, args, scaling, gqa)
    got = ops.extend(query, torch.empty_like(query), **args, scaling=scaling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    start = 0
    for prefix, new in lens:  # nothing cached: SGLang's own call, bit for bit
        if prefix == 0:
            assert torch.equal(got[start:start + new], want[start:start + new])
        start += new


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_extend_in_bfloat16_is_as_close_to_float32_as_sglangs_own(seed):
    query, args, _, scaling, gqa = batch(seed, torch.bfloat16)
    exact = sglang_own(query.float(), {k: v.float() if v.is_floating_point() else v for k, v in args.items()},
                       scaling, gqa)
    theirs = (sglang_own(query, args, scaling, gqa).float() - exact).abs().max()
    ours = (ops.extend(query, torch.empty_like(query), **args, scaling=scaling).float() - exact).abs().max()
    assert ours <= max(2 * theirs, 1e-2), (ours, theirs)


def test_a_prefix_of_thousands_and_one_new_token():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(4, 5000, 32, generator=gen), torch.randn(4, 5000, 32, generator=gen)
    q = torch.randn(8, 1, 32, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]
    torch.testing.assert_close(ops.attend(q, k, v, 4999, None), want, rtol=1e-5, atol=1e-6)


def decode_batch(seed: int, dtype=torch.float32):
    """A random decode batch as SGLang lays it out: 1-5 sequences of different lengths (1 to 700 tokens, the first
    seeds one sequence), their slots in pages scattered over the pool, req_to_token past each length holding slots
    that are not the sequence's (even out of the pool: nothing there may be read); MHA or GQA."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kv_heads = rng.choice((1, 2, 3))
    heads, dim, page = kv_heads * rng.choice((1, 2, 3)), rng.choice((16, 64)), PAGE_SIZES[seed % len(PAGE_SIZES)]
    lens = [rng.choice((1, 2, rng.randint(3, 700))) for _ in range(1 if seed < 4 else rng.randint(1, 5))]
    pages = [(n + page - 1) // page for n in lens]
    pool_pages = torch.randperm(sum(pages) + 8, generator=gen)
    slots = (len(pool_pages) + 1) * page
    req_to_token = torch.randint(slots, 10 ** 6, (8, max(lens) + page), generator=gen, dtype=torch.int32)
    order = rng.sample(range(8), len(lens))
    used = 0
    for row, n, count in zip(order, lens, pages, strict=True):
        req_to_token[row, :n] = (pool_pages[used:used + count, None] * page + torch.arange(page)).reshape(-1)[:n]
        used += count
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    query = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    args = dict(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, req_pool_indices=torch.tensor(order),
                seq_lens=torch.tensor(lens))
    return query, args, dim ** -0.5, heads != kv_heads


def sglang_own_decode(query, args, scaling, gqa, **extra):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as Backend

    original = internals.check()["decode"]
    return original(object.__new__(Backend), query, torch.zeros_like(query), **args, scaling=scaling,
                    enable_gqa=gqa, **extra)


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_equals_sglangs_own(seed):
    query, args, scaling, gqa = decode_batch(seed)
    assert ops.covers_decode(query, args["k_cache"], args["v_cache"], args["seq_lens"])
    want = sglang_own_decode(query, args, scaling, gqa)
    torch.testing.assert_close(ops.decode(query, torch.empty_like(query), **args, scaling=scaling), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_decode_in_bfloat16_is_as_close_to_float32_as_sglangs_own(seed):
    query, args, scaling, gqa = decode_batch(seed, torch.bfloat16)
    exact = sglang_own_decode(query.float(), {k: v.float() if v.is_floating_point() else v for k, v in args.items()},
                              scaling, gqa)
    theirs = (sglang_own_decode(query, args, scaling, gqa).float() - exact).abs().max()
    ours = (ops.decode(query, torch.empty_like(query), **args, scaling=scaling).float() - exact).abs().max()
    assert ours <= max(2 * theirs, 1e-2), (ours, theirs)


def test_decode_leaves_what_it_does_not_cover():
    query, args, _, _ = decode_batch(9)
    k, v, lens = args["k_cache"], args["v_cache"], args["seq_lens"]
    assert not ops.covers_decode(query[:-1], k, v, lens)  # not one query per sequence
    assert not ops.covers_decode(query, k, v, torch.zeros_like(lens))  # an empty sequence
    assert not ops.covers_decode(query, k, v[..., :8], lens)  # values of another head size
    assert not ops.covers_decode(query[:, :1], k[:, :1].expand(-1, 2, -1), v, lens)  # heads not a multiple


# --- the plugin against the installed SGLang ---------------------------------------------------------------------

# On a CUDA machine the plugin is a no-op by design (its no-op tests run there); CI has no GPU.
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(),  # skip-ok: GPU only
                               reason="the adaptation is for machines without CUDA")


@pytest.fixture
def backend_cls():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    original = dict(vars(TorchNativeAttnBackend))
    yield TorchNativeAttnBackend
    internals.undo()
    assert dict(vars(TorchNativeAttnBackend)) == original


class Pool:
    """A token-to-KV pool of one layer: what the backend calls on it (a fake: the pool is not under test)."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.loc], self.v[loc.loc] = k, v

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def forward_extend(backend_cls, seed, **layer_extra):
    """SGLang's own TorchNativeAttnBackend.forward_extend on a random batch, its new tokens' K/V written by it."""
    query, args, lens, scaling, _gqa = batch(seed)
    heads, kv_heads, dim = query.shape[1], args["k_cache"].shape[1], query.shape[2]
    new_slots = torch.cat([args["req_to_token"][r, p:p + n] for r, (p, n) in zip(args["req_pool_indices"].tolist(),
                                                                                   lens, strict=True)])
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=types.SimpleNamespace(
        req_to_token=args["req_to_token"]), token_to_kv_pool=Pool(args["k_cache"].clone(), args["v_cache"].clone()))
    backend = backend_cls(runner)
    layer = types.SimpleNamespace(qk_head_dim=dim, v_head_dim=dim, tp_q_head_num=heads, tp_k_head_num=kv_heads,
                                  is_cross_attention=False, attn_type=None, layer_id=0, scaling=scaling,
                                  sliding_window_size=None, **layer_extra)
    fb = types.SimpleNamespace(out_cache_loc=new_slots, req_pool_indices=args["req_pool_indices"],
                               seq_lens=args["seq_lens"], extend_prefix_lens=args["extend_prefix_lens"],
                               extend_seq_lens=args["extend_seq_lens"], encoder_lens=None)
    k_new, v_new = args["k_cache"][new_slots], args["v_cache"][new_slots]
    backend.init_forward_metadata(fb)
    return backend.forward_extend(query.reshape(len(query), -1), k_new, v_new, layer, fb).view_as(query)


@needs_cpu
@pytest.mark.parametrize("seed", SEEDS[:8])
def test_sglangs_backend_runs_through_the_plugin(backend_cls, monkeypatch, seed):
    want = forward_extend(backend_cls, seed)
    calls = []
    monkeypatch.setattr(ops, "extend", lambda *a, **k: calls.append(1) or extend(*a, **k))
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    got = forward_extend(backend_cls, seed)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


extend = ops.extend  # the real op, for the spy above


def forward_decode(backend_cls, seed, **layer_extra):
    """SGLang's own TorchNativeAttnBackend.forward_decode on a random batch, each sequence's last K/V written by it."""
    query, args, scaling, _gqa = decode_batch(seed)
    heads, kv_heads, dim = query.shape[1], args["k_cache"].shape[1], query.shape[2]
    rows, lens = args["req_pool_indices"], args["seq_lens"]
    new_slots = args["req_to_token"][rows, lens - 1].long()
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=types.SimpleNamespace(
        req_to_token=args["req_to_token"]), token_to_kv_pool=Pool(args["k_cache"].clone(), args["v_cache"].clone()))
    backend = backend_cls(runner)
    layer = types.SimpleNamespace(qk_head_dim=dim, v_head_dim=dim, tp_q_head_num=heads, tp_k_head_num=kv_heads,
                                  is_cross_attention=False, attn_type=None, layer_id=0, scaling=scaling,
                                  sliding_window_size=None, **layer_extra)
    fb = types.SimpleNamespace(out_cache_loc=new_slots, req_pool_indices=rows, seq_lens=lens, encoder_lens=None)
    backend.init_forward_metadata(fb)
    k_new, v_new = args["k_cache"][new_slots] + 1, args["v_cache"][new_slots] - 1
    return backend.forward_decode(query.reshape(len(query), -1), k_new, v_new, layer, fb).view_as(query)


@needs_cpu
@pytest.mark.parametrize("seed", SEEDS[2:10])
def test_sglangs_decode_runs_through_the_plugin(backend_cls, monkeypatch, seed):
    want = forward_decode(backend_cls, seed)
    calls = []
    monkeypatch.setattr(ops, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    got = forward_decode(backend_cls, seed)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


decode = ops.decode

DECODE_FALLBACKS = {
    "a sliding window": dict(sliding_window_size=7),
    "causal decode attention": dict(causal=True),
    "cross attention or encoder lengths": dict(encoder_lens=0),
}


@needs_cpu
@pytest.mark.parametrize("case", [*DECODE_FALLBACKS, "not one query per sequence"])
def test_what_decode_does_not_cover_is_sglangs_own_bit_for_bit(backend_cls, monkeypatch, caplog, case):
    query, args, scaling, gqa = decode_batch(7)
    extra = dict(DECODE_FALLBACKS.get(case, {}))
    if "encoder_lens" in extra:
        extra["encoder_lens"] = torch.zeros_like(args["seq_lens"])
    if case == "not one query per sequence":
        query = torch.cat([query, query])
    monkeypatch.setattr(ops, "decode", lambda *a, **k: pytest.fail("the plugin's op served a case it leaves alone"))
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    want = sglang_own_decode(query, args, scaling, gqa, **extra)
    got = torch.zeros_like(query)
    object.__new__(backend_cls)._run_sdpa_forward_decode(query, got, **args, scaling=scaling, enable_gqa=gqa, **extra)
    assert torch.equal(got, want) and "SGLang's own decode attention for" in caplog.text


FALLBACKS = {
    "a sliding window": dict(sliding_window_size=7),
    "non-causal attention": dict(causal=False),
    "cross attention or encoder lengths": dict(encoder_lens=torch.zeros(4, dtype=torch.int64)),
}


@needs_cpu
@pytest.mark.parametrize("case", [*FALLBACKS, "not prefix + new"])
def test_what_it_does_not_cover_is_sglangs_own_bit_for_bit(backend_cls, monkeypatch, caplog, case):
    query, args, lens, scaling, gqa = batch(5)
    extra = dict(FALLBACKS.get(case, {}))
    if "encoder_lens" in extra:
        extra["encoder_lens"] = extra["encoder_lens"][:len(lens)]
    if case == "not prefix + new":  # a sequence longer than prefix + new: SGLang's code decides what happens
        args["seq_lens"] = args["seq_lens"] + 1
    monkeypatch.setattr(ops, "extend", lambda *a, **k: pytest.fail("the plugin's op served a case it leaves alone"))
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    backend = object.__new__(backend_cls)
    got, want = torch.zeros_like(query), torch.zeros_like(query)
    error = None
    try:
        want = sglang_own(query, args, scaling, gqa, **dict(extra))
    except Exception as exc:  # whatever SGLang's own does, the patched method must do the same
        error = type(exc)
    if error:
        with pytest.raises(error):
            backend._run_sdpa_forward_extend(query, got, **args, scaling=scaling, enable_gqa=gqa,
                                             **{"causal": True, **extra})
    else:
        backend._run_sdpa_forward_extend(query, got, **args, scaling=scaling, enable_gqa=gqa,
                                         **{"causal": True, **extra})
        assert torch.equal(got, want)
    assert "SGLang's own extend attention for" in caplog.text


@pytest.mark.parametrize("value", [None, "0", "", "true"])
def test_no_op_unless_env_is_1(backend_cls, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV_VAR, value)
    plugin.register()
    assert not internals._undo and not any(hasattr(vars(backend_cls)[m], "__wrapped__") for m in internals.METHODS)


def test_no_op_when_torch_sees_cuda(backend_cls, monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugin.register()
    assert not internals._undo and not any(hasattr(vars(backend_cls)[m], "__wrapped__") for m in internals.METHODS)


@needs_cpu
def test_register_patches_once(backend_cls, monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    plugin.register()
    assert len(internals._undo) == 2
    assert backend_cls._run_sdpa_forward_extend.__wrapped__ and backend_cls._run_sdpa_forward_decode.__wrapped__


def _changed_method(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                    causal=False, is_cross_attn=False, sliding_window_size=None):
    return output  # same signature, other code: e.g. SGLang fixed it upstream


def _changed_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                    sliding_window_size=None):
    return output


CHANGES = {
    "TorchNativeAttnBackend is missing": lambda m, mp: mp.delattr(m, "TorchNativeAttnBackend"),
    "_run_sdpa_forward_extend has changed": lambda m, mp: mp.setattr(
        m.TorchNativeAttnBackend, "_run_sdpa_forward_extend", _changed_method),
    "_run_sdpa_forward_extend no longer takes": lambda m, mp: mp.setattr(
        m.TorchNativeAttnBackend, "_run_sdpa_forward_extend", lambda self, query, output: output),
    "forward_extend no longer calls": lambda m, mp: mp.setattr(
        m.TorchNativeAttnBackend, "forward_extend", lambda self, q, k, v, layer, forward_batch: q),
    "_run_sdpa_forward_decode has changed": lambda m, mp: mp.setattr(
        m.TorchNativeAttnBackend, "_run_sdpa_forward_decode", _changed_decode),
    "_run_sdpa_forward_decode no longer takes": lambda m, mp: mp.setattr(
        m.TorchNativeAttnBackend, "_run_sdpa_forward_decode", lambda self, query, output: output),
    "forward_decode no longer calls": lambda m, mp: mp.setattr(
        m.TorchNativeAttnBackend, "forward_decode", lambda self, q, k, v, layer, forward_batch: q),
    "has no op aten": lambda m, mp: mp.setattr(ops, "FLASH_OP", "_no_such_op_for_cpu"),
}


@needs_cpu
@pytest.mark.parametrize("change", CHANGES)
def test_refuses_at_load_naming_the_changed_internal(backend_cls, monkeypatch, change):
    import sglang.srt.layers.attention.torch_native_backend as module

    CHANGES[change](module, monkeypatch)
    assert "cluster.cpu_attention: false" in assert_plugin_refuses(plugin, internals, monkeypatch, change)
