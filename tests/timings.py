"""Where a test run's time goes, printed at its end (tests/conftest.py feeds it and prints it): the wall time of each
suite (top-level folder under tests/), and the setup of each package- or session-scoped fixture of the suites that
start SGLang or Docker: their clusters, engines, images and reference models, each once per scope.

A suite's time is the wall clock from its first test's setup to its last test's teardown, summed over its tests: a
package fixture's setup and teardown (a cluster's start and stop) fall into its suite. A fixture's time is its own
setup, without the fixtures it depends on (pytest sets those up first, each timed on its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Shorter fixture setups (an HTTP client, a temporary folder) would only lengthen the table.
FIXTURE_MIN_SECONDS = 1.0


@dataclass
class Timings:
    suites: dict[str, list[float]] = field(default_factory=dict)    # suite -> [tests, seconds], in run order
    fixtures: dict[str, list[float]] = field(default_factory=dict)  # "suite: fixture" -> [setups, seconds]

    def add_test(self, suite: str, seconds: float) -> None:
        entry = self.suites.setdefault(suite, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def add_fixture(self, suite: str, fixture: str, seconds: float) -> None:
        entry = self.fixtures.setdefault(f"{suite}: {fixture}", [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def lines(self) -> list[str]:
        """The table: suites in run order with their share of the total, then the slow fixture setups, slowest
        first."""
        if not self.suites:
            return []
        total = sum(seconds for _, seconds in self.suites.values())
        rows = [f"{'suite (run order)':<40} {'tests':>6} {'wall s':>8} {'share':>6}"]
        for suite, (tests, seconds) in self.suites.items():
            rows.append(f"{suite:<40} {tests:>6.0f} {seconds:>8.1f} {seconds / (total or 1):>6.0%}")
        rows.append(f"{'all suites':<40} {sum(t for t, _ in self.suites.values()):>6.0f} {total:>8.1f}")
        slow = sorted(((name, n, s) for name, (n, s) in self.fixtures.items() if s >= FIXTURE_MIN_SECONDS),
                      key=lambda row: -row[2])
        if slow:
            rows += ["", f"{'fixture setup, SGLang or Docker suites':<40} {'setups':>6} {'s':>8}"]
            rows += [f"{name:<40} {n:>6.0f} {seconds:>8.1f}" for name, n, seconds in slow]
        return rows
