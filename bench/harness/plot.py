"""What every picture under bench/ (and tests/chaos's) does the same way: matplotlib with no display, the machine in
the title, the figure laid out, written and closed."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (these machines have no display). Imported when a picture is drawn, at
    the end of a run: the modules that draw import without matplotlib (the `bench` extra), e.g. under the tests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def stamp(machine: dict) -> str:
    """The machine a result was measured on, for a title: bench.harness.machine.machine()'s cores, date and commit."""
    return f"{machine['cpu_count']} CPUs, {machine['date_utc']}, commit {(machine.get('git_commit') or '?')[:8]}"


def save(fig, path: Path, dpi: int = 100) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)  # a long run draws more than one: free each
