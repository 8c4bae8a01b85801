"""docker/requirements.py: what keys the image's heavy layer (torch, SGLang: several GB, minutes to install). Its output
is the only input of that layer, so it must change when the image's dependencies do and only then: a new test or
bench tool in pyproject.toml must not reinstall torch in every image build."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "requirements.py"


def _module():
    spec = importlib.util.spec_from_file_location("docker_requirements", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_the_test_and_bench_extras_do_not_change_the_images_requirements(pyproject, target):
    requirements = _module().requirements
    changed = copy.deepcopy(pyproject)
    extras = changed["project"]["optional-dependencies"]
    extras["test"] = [*extras["test"], "schemathesis==4.0.0"]
    extras["bench"] = ["matplotlib==0.0.1"]
    assert requirements(changed, target) == requirements(pyproject, target)
    for tool in (*pyproject["project"]["optional-dependencies"]["test"], "schemathesis==4.0.0"):
        assert tool not in requirements(pyproject, target)


def test_a_dependency_or_the_build_backend_changes_them(pyproject):
    requirements = _module().requirements
    for key in ("dependencies", "build-system"):
        changed = copy.deepcopy(pyproject)
        if key == "dependencies":
            changed["project"]["dependencies"] = [*changed["project"]["dependencies"], "numpy==1.0"]
        else:
            changed["build-system"]["requires"] = ["setuptools>=99"]
        assert requirements(changed, "cpu") != requirements(pyproject, "cpu"), key


def test_the_dockerfiles_command_prints_them_one_a_line(pyproject):
    out = subprocess.run([sys.executable, str(SCRIPT), str(REPO / "pyproject.toml"), "cpu"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert out.splitlines() == _module().requirements(pyproject, "cpu")
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "python /usr/local/bin/requirements.py /tmp/pyproject.toml $target > /requirements-$target.txt" in dockerfile
    assert "COPY --from=requirements /requirements-cpu.txt /tmp/requirements.txt" in dockerfile
