"""bench.kv_handoff.plan: the KV bytes a prompt moves and the transfers SGLang's mooncake connector makes of them."""

from bench.kv_handoff.plan import (
    group_contiguous,
    kv_bytes_per_token,
    kv_shape,
    page_indices,
    page_item_bytes,
    plan,
    transfer_blocks,
)

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "dtype": "float32"}


def test_smollm2_is_45_kib_per_token_and_48_kib_per_page_of_one_tensor():
    shape = kv_shape(SMOLLM2)
    assert kv_bytes_per_token(shape) == 30 * 2 * 3 * 64 * 4 == 46080
    assert page_item_bytes(shape) == 64 * 3 * 64 * 4 == 49152


def test_head_dim_defaults_to_hidden_over_heads_and_bf16_is_2_bytes():
    shape = kv_shape({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "bfloat16"})
    assert (shape["kv_heads"], shape["head_dim"], shape["elem_bytes"]) == (4, 64, 2)


def test_runs_break_where_either_side_is_not_the_next_page():
    # as SGLang's group_concurrent_contiguous: [0,1,2] -> [5,6,7] merges; 3 -> 9 breaks on the decode side only
    assert group_contiguous([0, 1, 2, 3, 4], [5, 6, 7, 9, 10]) == [(0, 5, 3), (3, 9, 2)]
    assert group_contiguous([4, 3], [0, 1]) == [(4, 0, 1), (3, 1, 1)]
    assert group_contiguous([], []) == []


def test_blocks_are_every_tensor_times_every_run_in_one_batch_by_default():
    runs = group_contiguous([0, 1, 5], [2, 3, 4])
    blocks = transfer_blocks([1000, 2000], [9000, 8000], 10, runs)
    assert blocks == [(1000, 9020, 20), (1050, 9040, 10), (2000, 8020, 20), (2050, 8040, 10)]
    assert plan([1000, 2000], [9000, 8000], 10, [0, 1, 5], [2, 3, 4]) == [blocks]


def test_max_batch_pages_splits_the_page_indices_and_groups_within_each_slice():
    batches = plan([0], [100], 1, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], max_batch_pages=2)
    assert batches == [[(0, 100, 2)], [(2, 102, 2)], [(4, 104, 1)]]


def test_layouts():
    assert page_indices(3, 8, "contiguous") == ([0, 1, 2], [0, 1, 2])
    src, dst = page_indices(64, 128, "scattered", seed=1)
    assert len(set(src)) == len(set(dst)) == 64 and max(src + dst) < 128
    assert page_indices(64, 128, "scattered", seed=1) == (src, dst)
