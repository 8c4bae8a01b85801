"""A decode worker with no prefill (configs/decode-only.yaml: SGLang's fake KV transfer), started by pdcluster's own
launcher on a port of its own, as `python -m bench.cluster --decode-only` starts it. If it cannot start, the tests
error (never skip)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from bench.cluster import decode_only
from tests.e2e.conftest import demo_model  # noqa: F401 - the fixture, shared by import

PORT = 21650  # not bench.cluster.decode_only's 21600: a benchmark and this test may be started one after the other


@pytest.fixture(scope="package")  # gone before the other clusters of `make test` start
def decode_worker(demo_model) -> str:  # noqa: F811 - the imported fixture
    log_dir = Path(tempfile.mkdtemp(prefix="e2e-decode-only-"))
    worker = decode_only.start_worker(log_dir, PORT)
    try:
        decode_only.wait_ready(worker)
    except Exception:
        worker.stop()
        print(f"----- decode-only worker log -----\n{worker.log.read_text(errors='replace')[-4000:]}",
              file=sys.stderr)
        raise
    yield worker.url
    worker.stop()


@pytest.fixture
def client(decode_worker) -> httpx.Client:
    # SGLang closes an idle connection after 5 s, httpx's default too: let go first, or a reuse races the close.
    limits = httpx.Limits(keepalive_expiry=2.0)
    with httpx.Client(base_url=decode_worker, timeout=120, limits=limits) as client:
        yield client
