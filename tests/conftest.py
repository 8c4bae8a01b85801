"""The order of a full run (`make test`) and the `cluster` marker, for every suite under tests/, in one place.

Order: one cluster at a time. Each CPU SGLang worker takes 2.4-3 GB of RAM (and SGLang checks for free RAM beyond
its KV pool when a worker starts), so two suites' clusters must never be up together. Every suite's cluster is
package-scoped, torn down after its last test, except tests/e2e's, which lives for the whole session: that suite
runs last. Within a suite, files keep pytest's order (by name) unless listed below.

Marker: every test of a suite that starts SGLang processes or Docker is marked `cluster`, so that
`pytest -m "not cluster"` (`make quick`) runs everything else, no lock needed, in a few minutes.

Time: the end of every run prints each suite's wall time and what each cluster start cost (tests/timings.py), so
that one CI log shows where `make test`'s budget goes.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest

from bench.harness.postgres import PostgresServer
from tests.timings import Timings

TESTS = Path(__file__).parent
TIMINGS = Timings()

# tests/chaos is the chaos soak (`make chaos`): a program with a cluster of its own, never collected as tests.
collect_ignore = ["chaos"]

# (path under tests/, starts SGLang or Docker), in the order of a full run. A test takes the place of the most specific
# path that covers it; a test file under tests/ that none covers stops the run: a new suite is placed here on purpose.
ORDER: list[tuple[str, bool]] = [
    # One decode worker on fake KV (~2.4 GB), package-scoped: gone before the next suite starts.
    ("e2e_decode_only", True),
    # Clusters with the KV cache on disk (package scope). Each test states the shape it needs and the cluster restarts
    # only the workers whose options or weights differ, so this order only saves restarts (each a SGLang start of
    # ~30-60 s, and a check for free RAM): test_model_identity ends on the other-weights model that
    # test_disk_limits then keeps, so that only its prefill restarts.
    ("e2e_persistence/test_restart_from_disk.py", True),
    ("e2e_persistence/test_shared_kv.py", True),
    ("e2e_persistence/test_model_identity.py", True),
    ("e2e_persistence/test_disk_limits.py", True),
    ("e2e_persistence", True),  # a file added later: after those four
    # SmolLM2 through one prefill and one decode (~3 GB each), package-scoped.
    ("e2e_smollm2", True),
    ("e2e_smollm2/test_pinned.py", True),  # leaves both workers pinned to a core each: the suite's last test
    # Live role flips: tiny-llama, 2 prefills + 1 decode, every worker switch-enabled (package-scoped); the planner's
    # tests of real flips join this cluster.
    ("e2e_flip", True),
    # No SGLang process, no Docker: fakes, in-process servers, dry runs, the wheel (`make quick` runs these alone).
    # Between the clusters only because that is where they have always run; memory does not care.
    ("unit", False),
    # The cpu image under `docker compose` (2P+2D, package-scoped): the engine and its containers are gone before
    # tests/e2e's cluster starts.
    ("compose", True),
    # One 2P+2D cluster for the whole session (alive until the run ends): after every other suite.
    ("e2e", True),
    # These kill, stop, drain and restart workers and the router of that shared cluster (and leave every worker
    # serving again): after the other e2e tests, so that no other test meets a worker that is coming back;
    # worker_failure last of all.
    ("e2e/test_planned_events.py", True),
    ("e2e/test_self_healing.py", True),
    ("e2e/test_worker_failure.py", True),
]


def _place(path: Path) -> int | None:
    """Index in ORDER of the most specific entry covering `path` (None: not under tests/, or covered by none)."""
    if not path.is_relative_to(TESTS):
        return None
    relative = path.relative_to(TESTS)
    covering = [i for i, (entry, _) in enumerate(ORDER)
                if relative == Path(entry) or Path(entry) in relative.parents]
    return max(covering, key=lambda i: len(Path(ORDER[i][0]).parts), default=None)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything: it reads the marker added here
def pytest_collection_modifyitems(config, items):
    places: dict[object, int] = {}
    unplaced = set()
    for item in items:
        path = Path(item.path)
        place = _place(path)
        if place is None:
            if path.is_relative_to(TESTS):
                unplaced.add(str(path.relative_to(TESTS)))
            place = len(ORDER)  # not ours to order: after every suite
        elif ORDER[place][1]:
            item.add_marker(pytest.mark.cluster)
        places[item] = place
    if unplaced:
        raise pytest.UsageError(f"tests/conftest.py's ORDER places no suite for {', '.join(sorted(unplaced))}: add it "
                                "there (where it runs, and whether it starts SGLang or Docker)")
    items.sort(key=places.__getitem__)  # stable: within a place, pytest's own order


def _suite(path: Path) -> str:
    """A test's or fixture's suite: its top-level folder under tests/."""
    return path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else str(path)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.monotonic()  # setup, call and teardown: a package fixture's start and stop count for its suite
    try:
        return (yield)
    finally:
        TIMINGS.add_test(_suite(Path(item.path)), time.monotonic() - started)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    started = time.monotonic()  # pytest has set up this fixture's dependencies already: its own setup alone
    try:
        return (yield)
    finally:
        if fixturedef.scope in ("package", "session"):
            source = Path(inspect.getfile(fixturedef.func))
            place = _place(source)
            if place is not None and ORDER[place][1]:  # a suite that starts SGLang or Docker
                TIMINGS.add_fixture(_suite(source), fixturedef.argname, time.monotonic() - started)


def pytest_terminal_summary(terminalreporter):
    if lines := TIMINGS.lines():
        terminalreporter.section("time per suite and per cluster start (tests/timings.py)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL for this test process (bench/harness/postgres.py), started by the first test that needs it
    (the store's unit tests, the SmolLM2 suite's routers sharing one store) and stopped at the end. One that cannot
    start fails the tests that need it: never a skip."""
    server = PostgresServer()
    try:
        server.start()
    except Exception as exc:
        server.stop()
        pytest.fail(f"PostgreSQL did not start: {exc}")
    yield server
    server.stop()
    assert not server.running()
