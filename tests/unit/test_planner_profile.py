"""The profiler's arithmetic (planner/measurements.py) on made-up timings, worked out by hand; and its command line's
defaults (the run itself needs a real cluster: `make profile`)."""

from __future__ import annotations

import pytest

from planner.measurements import decode_point, fits_in_kv, full_batch_window, prefill_point, token_gaps
from planner.profile import parse


def test_prefill_point_is_length_over_the_median_ttft_with_the_range_kept():
    point = prefill_point(1000, [2.0, 2.5, 4.0])  # rates 500, 400, 250
    assert point.tokens_per_s == pytest.approx(400.0)  # 1000 / median 2.5
    assert point.spread == pytest.approx(250.0)
    assert point.samples == 3
    with pytest.raises(ValueError):
        prefill_point(1000, [])
    with pytest.raises(ValueError):
        prefill_point(1000, [1.0, 0.0])


def test_a_chunk_of_several_tokens_counts_as_that_many_equal_gaps():
    chunks = [(10.0, 1), (10.1, 2), (10.4, 5), (10.4, 5), (10.6, 6)]
    gaps = token_gaps(chunks)
    assert [t for t, _ in gaps] == [10.1, 10.4, 10.4, 10.4, 10.6]
    assert [g for _, g in gaps] == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.2])


def test_decode_point_counts_only_gaps_while_every_stream_ran():
    # Stream a starts at t=0 and steps every 0.1 s to t=1.0; stream b starts at 0.5 and steps every 0.2 s until 1.7.
    a = [(round(0.1 * k, 3), k + 1) for k in range(11)]  # tokens 1..11 at 0.0 .. 1.0
    b = [(round(0.5 + 0.2 * k, 3), k + 1) for k in range(7)]  # tokens 1..7 at 0.5 .. 1.7
    assert full_batch_window([a, b]) == (0.5, 1.0)
    point = decode_point(2, 300, [a, b])
    assert point is not None
    # In (0.5, 1.0]: a's gaps ending at 0.6 .. 1.0 (5 of 0.1 s), b's ending at 0.7 and 0.9 (2 of 0.2 s).
    assert point.samples == 7
    assert point.itl_s == pytest.approx(0.1)  # the median of [0.1] x 5 + [0.2] x 2
    assert point.batch == 2 and point.context_tokens == 300
    assert point.spread == pytest.approx(0.1)  # quartiles (exclusive method) 0.1 and 0.2


def test_streams_that_never_overlap_make_no_point():
    a = [(0.0, 1), (0.1, 2)]
    b = [(5.0, 1), (5.1, 2)]
    assert decode_point(2, 300, [a, b]) is None
    assert decode_point(3, 300, [a, b]) is None  # fewer streams than the batch claims


def test_a_batch_the_kv_pool_cannot_hold_is_skipped():
    assert fits_in_kv(16, 512, 64, 16384)  # 16 x 576 = 9216 <= 0.9 x 16384
    assert not fits_in_kv(16, 1024, 64, 16384)  # 17408
    assert fits_in_kv(64, 4096, 64, None)  # an unknown pool: try


def test_default_output_is_named_after_the_model():
    args = parse(["--model", "models/smollm2-135m-instruct"])
    assert args.out == "configs/profiles/smollm2-135m-instruct.json"
    assert args.batches == [1, 2, 4, 8, 16] and min(args.prompt_lengths) == 64 and max(args.prompt_lengths) == 4096
