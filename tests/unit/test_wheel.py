"""Packaging: the wheel built from this tree installs, and its commands run, with no checkout in sight.

One wheel is built (offline, from a copy of the tree, so the checkout gets no build/ or egg-info) and installed
--no-deps into a fresh venv. That venv reaches the project venv's dependencies (SGLang, torch, ...) through a .pth
file naming its site-packages: a plain path line, so the project venv's own .pth files (its editable install of this
checkout among them) are not run. Every command then runs from a directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["pdcluster-prefill", "pdcluster-decode", "pdcluster-router", "pdcluster-bootstrap", "pdcluster-local",
           "pdcluster-kvstore", "pdcluster-planner"]
# What a fresh clone has besides the sources: never part of a build.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "models", "logs", "kv-cache", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache")

pytestmark = pytest.mark.packaging


@dataclass
class Installed:
    wheel: Path
    venv: Path
    site: Path  # the fresh venv's site-packages, where the wheel went
    outside: Path  # a working directory outside the checkout
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=self.outside, env=self.env, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{shlex.join(proc.args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    assert not tmp.resolve().is_relative_to(REPO), "the test's directory must be outside the checkout"
    src, dist, venv, outside = tmp / "src", tmp / "dist", tmp / "venv", tmp / "elsewhere"
    shutil.copytree(REPO, src, ignore=NOT_SOURCES, symlinks=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    check(subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src)],
                         capture_output=True, text=True, timeout=300))
    wheel = next(dist.glob("pdcluster-*.whl"))

    check(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True,
                         timeout=120))
    python = venv / "bin" / "python"
    site = Path(check(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, timeout=60)).strip())
    # The dependencies: this interpreter's site-packages (the project venv that `make setup` made), after the wheel's.
    (site / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # pip of this interpreter installs into the fresh venv (which has none of its own), offline; --ignore-installed:
    # the project venv's own pdcluster (seen through the .pth) is never a candidate for uninstalling.
    check(subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "--ignore-installed",
                          str(wheel)],
                         capture_output=True, text=True, timeout=300))

    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env |= {"PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}
    return Installed(wheel, venv, site.resolve(), outside, env)


def test_the_wheel_has_the_cpu_shim_inside_pdcluster_and_no_top_level_sgl_kernel(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert "pdcluster/plugins/cpu_shim/sgl_kernel/__init__.py" in names
    assert not [n for n in names if n.startswith("sgl_kernel/")], "the stand-in must not shadow the real sgl_kernel"
    for package in ("router/checks/inventory/", "prefill/", "decode/", "bootstrap/"):
        assert any(n.startswith(package) for n in names), package


IMPORTS = r"""
import json, sys
import pdcluster.local.cluster, pdcluster.worker.cli, pdcluster.worker.plan, pdcluster.kvstore.cli
launcher_imports_roles = sorted(m for m in ("prefill", "decode", "router", "bootstrap") if m in sys.modules)
import bootstrap.app, decode.plan, prefill.plan, router.app, router.checks.inventory, router.pd.pairing
print(json.dumps({"files": {m.__name__: m.__file__ for m in (pdcluster, bootstrap, decode, prefill, router,
                                                              router.checks.inventory, router.pd.pairing)},
                  "launcher_imports_roles": launcher_imports_roles}))
"""


def test_the_packages_import_from_the_installed_wheel_not_the_checkout(installed):
    result = json.loads(check(installed.run("python", "-c", IMPORTS)))
    for module, file in result["files"].items():
        assert Path(file).resolve().is_relative_to(installed.site), f"{module} imported from {file}"
    assert result["launcher_imports_roles"] == [], "pdcluster's worker launcher imports the components that use it"


def test_every_entry_point_the_wheel_declares_loads_from_it(installed):
    """Console scripts and SGLang plugins, as pyproject.toml declares them: a module the wheel declares but does not
    hold fails here (one SGLang plugin was once missing from the wheel)."""
    loaded = check(installed.run(str(installed.venv / "bin" / "python"), "-c", (
        "from importlib.metadata import distribution\n"
        "for ep in distribution('pdcluster').entry_points:\n"
        "    ep.load()\n"
        "    print(ep.group, ep.name)\n")))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {("console_scripts", name) for name in project["scripts"]} | {
        (group, name) for group, points in project["entry-points"].items() for name in points}
    assert {tuple(line.split()) for line in loaded.splitlines()} == declared


def test_every_console_script_answers_help(installed):
    for script in SCRIPTS:
        assert (installed.venv / "bin" / script).is_file(), script
        assert "usage:" in check(installed.run(script, "--help")), script


def test_the_installed_prefill_puts_the_installed_cpu_shim_first_on_sglangs_path(installed, demo_model):
    config = installed.outside / "prefill.yaml"
    config.write_text(f"model-path: {demo_model}\nport: 0\ncluster:\n  device: cpu\n  bootstrap_url: null\n")
    out = check(installed.run("pdcluster-prefill", "--config", str(config), "--dry-run"))
    words = shlex.split(out.strip().splitlines()[-1])
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    shim = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert shim == installed.site / "pdcluster" / "plugins" / "cpu_shim", env["PYTHONPATH"]
    assert (shim / "sgl_kernel" / "__init__.py").is_file()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    start = words.index("-m") - 1  # SGLang runs on the venv's interpreter, which finds the wheel's plugin too
    assert words[start:start + 3] == [str(installed.venv / "bin" / "python"), "-m", "sglang.launch_server"], words


def test_the_installed_bootstrap_service_serves_health(installed):
    port = free_port()
    proc = subprocess.Popen(["pdcluster-bootstrap", "--host", "127.0.0.1", "--port", str(port)], cwd=installed.outside,
                            env=installed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, status = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None and status != 200:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.2)
        assert status == 200, f"no 200 from /health (exit status {proc.poll()})"
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    # uvicorn shuts down on SIGTERM, then re-raises it (as `python -m bootstrap` from the checkout does)
    assert proc.returncode in (0, -signal.SIGTERM), output


def test_the_installed_router_validates_a_config(installed):
    config = json.loads(check(installed.run("pdcluster-router", "--config", str(REPO / "configs" / "router.yaml"),
                                            "--port", "18123", "--dry-run")))
    assert config["port"] == 18123 and config["prefill_policy"] == "cache_aware"
    bad = installed.outside / "router.yaml"
    bad.write_text("prefill_policy: fastest\n")
    refused = installed.run("pdcluster-router", "--config", str(bad), "--dry-run")
    assert refused.returncode != 0 and "prefill_policy" in refused.stderr, refused.stderr
