"""The time table printed at the end of every run (tests/timings.py): what a CI log shows of where the time went."""

from __future__ import annotations

from tests.timings import Timings


def test_suites_in_run_order_with_their_share_then_slow_fixture_setups_slowest_first():
    timings = Timings()
    for suite, seconds in [("e2e_smollm2", 100.0), ("e2e_smollm2", 50.0), ("unit", 25.0), ("compose", 125.0)]:
        timings.add_test(suite, seconds)
    timings.add_fixture("compose", "image", 90.0)
    timings.add_fixture("e2e_smollm2", "cluster", 40.0)
    timings.add_fixture("e2e_smollm2", "cluster", 20.5)  # a package fixture set up again: counted and summed
    timings.add_fixture("compose", "router", 0.2)  # an HTTP client: below the table's threshold
    assert timings.lines() == [
        "suite (run order)                         tests   wall s  share",
        "e2e_smollm2                                   2    150.0    50%",
        "unit                                          1     25.0     8%",
        "compose                                       1    125.0    42%",
        "all suites                                    4    300.0",
        "",
        "fixture setup, SGLang or Docker suites   setups        s",
        "compose: image                                1     90.0",
        "e2e_smollm2: cluster                          2     60.5",
    ]


def test_a_run_without_fixtures_worth_listing_prints_only_the_suites():
    timings = Timings()
    timings.add_test("unit", 0.0)
    timings.add_fixture("compose", "router", 0.5)
    assert timings.lines() == [
        "suite (run order)                         tests   wall s  share",
        "unit                                          1      0.0     0%",
        "all suites                                    1      0.0",
    ]


def test_nothing_run_prints_nothing():
    assert Timings().lines() == []
