"""bench/planner/flip.py's verdict: a flip counts from the end of the drain to serving (switch + admission), and a
run meets the target only with every flip under it, nothing lost and every answer token-exact."""

from __future__ import annotations

from bench.planner.flip import OUTCOME, summary


def test_the_cli_outcome_line_gives_drain_and_switch_seconds():
    line = "prefill-127.0.0.1-13101: prefill -> decode done: drained in 2.31s, switched in 6.05s\n"
    match = OUTCOME.search(line)
    assert match and (float(match[1]), float(match[2])) == (2.31, 6.05)


def test_a_lost_or_changed_answer_or_a_slow_flip_misses_the_target():
    flips = [{"to": "decode", "drain_s": 30.0, "switch_s": 6.0, "admission_s": 1.5, "flip_s": 7.5},
             {"to": "prefill", "drain_s": 1.0, "switch_s": 5.0, "admission_s": 0.5, "flip_s": 5.5}]
    expected = {"a": [1, 2], "b": [3]}
    good = [("a", 200, [1, 2]), ("b", 200, [3])]
    verdict = summary(flips, good, expected)
    assert verdict["met"] and verdict["flip_s_median"] == 6.5 and verdict["drain_s_median"] == 15.5
    assert summary(flips, [*good, ("a", 503, [])], expected)["lost"] == 1
    changed = summary(flips, [*good, ("b", 200, [4])], expected)
    assert (changed["not_token_exact"], changed["met"]) == (1, False)
    slow = summary([*flips, {**flips[0], "flip_s": 15.1}], good, expected)
    assert (slow["flip_s_max"], slow["met"]) == (15.1, False)
