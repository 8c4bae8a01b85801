"""Fixtures shared by the unit tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.config import StoreConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The CPU demo model, which the launcher's validation reads (its config): built if `make setup` has not."""
    model = REPO / "models" / "tiny-llama"
    if not (model / "config.json").is_file():  # `make setup` builds it; the image has its own
        subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", "models/tiny-llama"], cwd=REPO,
                       check=True)
    return model


@pytest.fixture(params=["sqlite", "postgresql"])
def store_config(request, tmp_path) -> StoreConfig:
    """The store's config on each backend: a SQLite file in a fresh dir (its folder not made yet), or a fresh database
    of the session's PostgreSQL (tests/conftest.py)."""
    if request.param == "sqlite":
        return StoreConfig(url=f"sqlite+aiosqlite:///{tmp_path}/var/responses.db", max_item_bytes=4096)
    server = request.getfixturevalue("postgres")
    return StoreConfig(backend="postgresql", url=server.new_database(), max_item_bytes=4096)
