"""The capacity model (pdcluster/common/capacity.py) against values worked out by hand from a small profile:

prefill: 100 tokens at 200 tokens/s, 1000 at 500, 2000 at 400 (a dip past 1000 is kept: nothing assumes monotone);
decode, context 100: batch 1 at 50 ms, 4 at 80 ms, 8 at 120 ms; context 1000: batch 1 at 60 ms, 4 at 100 ms.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from pdcluster.common.capacity import DecodePoint, PrefillPoint, Profile, interpolate


def profile(**changes) -> Profile:
    fields = {
        "model": "test-model", "hardware": "a test", "measured_at": datetime(2026, 12, 1, tzinfo=UTC),
        "method": "by hand",
        # Given out of order: the profile sorts its points once.
        "prefill": [PrefillPoint(prompt_tokens=1000, tokens_per_s=500),
                    PrefillPoint(prompt_tokens=100, tokens_per_s=200),
                    PrefillPoint(prompt_tokens=2000, tokens_per_s=400)],
        "decode": [DecodePoint(batch=4, context_tokens=100, itl_s=0.08),
                   DecodePoint(batch=1, context_tokens=100, itl_s=0.05),
                   DecodePoint(batch=8, context_tokens=100, itl_s=0.12),
                   DecodePoint(batch=1, context_tokens=1000, itl_s=0.06),
                   DecodePoint(batch=4, context_tokens=1000, itl_s=0.10)],
    }
    fields.update(changes)
    return Profile(**fields)


def test_interpolate_is_piecewise_linear_and_clamped():
    xs, ys = [100, 1000, 2000], [200.0, 500.0, 400.0]
    assert interpolate(xs, ys, 100) == 200.0
    assert interpolate(xs, ys, 550) == pytest.approx(350.0)  # 200 + 300 x 450/900
    assert interpolate(xs, ys, 1500) == pytest.approx(450.0)  # 500 - 100 x 500/1000
    assert interpolate(xs, ys, 10) == 200.0  # clamped, not 200 - 300 x 90/900 = 170
    assert interpolate(xs, ys, 9000) == 400.0  # clamped, not extrapolated down to -300
    assert interpolate([5], [7.0], 1e9) == 7.0


def test_interpolate_refuses_unordered_or_empty_points():
    with pytest.raises(ValueError, match="strictly increasing"):
        interpolate([1, 1], [2.0, 3.0], 1)
    with pytest.raises(ValueError, match="at least one point"):
        interpolate([], [], 1)


def test_prefill_rate_seconds_and_queue_wait():
    p = profile()
    assert p.prefill_tokens_per_s(550) == pytest.approx(350.0)
    assert p.prefill_seconds(550) == pytest.approx(550 / 350)
    assert p.prefill_seconds(1000) == pytest.approx(2.0)
    assert p.prefill_seconds(2000) == pytest.approx(5.0)  # slower per token than 1000: kept as measured
    assert p.prefill_seconds(4000) == pytest.approx(10.0)  # 4000 at the last measured rate (400/s)
    assert p.queue_wait_seconds(1200, mean_prompt_tokens=1000) == pytest.approx(2.4)
    assert p.queue_wait_seconds(1200) == pytest.approx(6.0)  # unknown lengths: the slowest rate, 200/s
    with pytest.raises(ValueError):
        p.prefill_seconds(0)


def test_decode_itl_along_batch_then_context():
    p = profile()
    assert p.decode_itl(1, 100) == pytest.approx(0.05)
    assert p.decode_itl(2, 100) == pytest.approx(0.06)  # 0.05 + 0.03 x 1/3
    assert p.decode_itl(2, 1000) == pytest.approx(0.06 + 0.04 / 3)
    assert p.decode_itl(2, 550) == pytest.approx((0.06 + 0.06 + 0.04 / 3) / 2)  # halfway between the contexts
    assert p.decode_itl(6, 100) == pytest.approx(0.10)  # 0.08 + 0.04 x 2/4
    assert p.decode_itl(6, 1000) == pytest.approx(0.10)  # batch 4 is the largest measured there: clamped
    assert p.decode_itl(2, 5000) == pytest.approx(p.decode_itl(2, 1000))  # beyond the last context: clamped
    assert p.decode_tokens_per_s(4, 100) == pytest.approx(4 / 0.08)


def test_largest_decode_batch_within_an_itl_bound():
    p = profile()
    assert p.largest_measured_batch(100) == 8
    assert p.largest_measured_batch(550) == 4  # the smaller of the two contexts around it
    assert p.max_decode_batch(0.105, 100) == 6  # itl(6) = 0.100, itl(7) = 0.110
    assert p.max_decode_batch(0.5, 100) == 8  # never beyond the measured batches
    assert p.max_decode_batch(0.5, 550) == 4
    assert p.max_decode_batch(0.01, 100) == 0  # one request alone misses it
    with_memory = profile(decode_kv_tokens=500)
    assert with_memory.max_decode_batch(0.105, 100) == 5  # 500 KV tokens hold 5 requests of 100
    assert with_memory.max_decode_batch(0.105, 100, kv_tokens_per_request=250) == 2


def test_a_dip_after_a_miss_is_not_counted_on():
    dip = profile(decode=[DecodePoint(batch=1, context_tokens=100, itl_s=0.05),
                          DecodePoint(batch=2, context_tokens=100, itl_s=0.2),
                          DecodePoint(batch=4, context_tokens=100, itl_s=0.06)])
    assert dip.decode_itl(4, 100) == pytest.approx(0.06)  # kept as measured
    assert dip.max_decode_batch(0.1, 100) == 1


@pytest.mark.parametrize("changes, problem", [
    ({"prefill": []}, "at least 1"),
    ({"decode": []}, "at least 1"),
    ({"prefill": [{"prompt_tokens": 100, "tokens_per_s": 0}]}, "greater than 0"),
    ({"prefill": [{"prompt_tokens": 0, "tokens_per_s": 10}]}, "greater than or equal to 1"),
    ({"decode": [{"batch": 1, "context_tokens": 100, "itl_s": -0.1}]}, "greater than 0"),
    ({"flip_seconds": 0}, "greater than 0"),
    ({"prefill": [{"prompt_tokens": 100, "tokens_per_s": 10}, {"prompt_tokens": 100, "tokens_per_s": 20}]},
     "two prefill points"),
    ({"decode": [{"batch": 1, "context_tokens": 100, "itl_s": 0.1}] * 2}, "two decode points"),
    ({"model": ""}, "at least 1 character"),
    ({"gpu": "none"}, "Extra inputs"),
])
def test_a_bad_profile_is_refused(changes, problem):
    with pytest.raises(ValidationError, match=problem):
        profile(**changes)


def test_json_round_trip_keeps_every_point(tmp_path):
    p = profile(flip_seconds=0.5, decode_kv_tokens=16384)
    p.dump(tmp_path / "profiles" / "p.json")
    back = Profile.load(tmp_path / "profiles" / "p.json")
    assert back == p
    assert [q.prompt_tokens for q in back.prefill] == [100, 1000, 2000]
