"""Fixtures shared by the unit tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The CPU demo model, which the launcher's validation reads (its config): built if `make setup` has not."""
    model = REPO / "models" / "tiny-llama"
    if not (model / "config.json").is_file():  # `make setup` builds it; the image has its own
        subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", "models/tiny-llama"], cwd=REPO,
                       check=True)
    return model
