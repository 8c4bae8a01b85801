"""The machine a result was measured on, recorded beside every result: its CPU, memory, load, the packages measured
and the commit, so that a number is never read apart from where and when it was taken."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata

import psutil

from bench.harness.paths import REPO

PACKAGES = ("sglang", "sglang-router", "fastapi", "starlette", "uvicorn", "httpx", "httpcore", "h11", "anyio",
            "httptools", "uvloop", "aiohttp", "orjson", "httpx2", "matplotlib", "psutil")


def git(*args: str) -> str | None:
    try:
        found = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        return found.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((ln.split(":", 1)[1].strip() for ln in handle if ln.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # The router measured is the working tree's: its commit, and whether router/ had uncommitted changes.
        "git_commit": git("rev-parse", "HEAD"), "router_uncommitted_changes": bool(git("status", "--porcelain",
                                                                                        "router/")),
        "platform": platform.platform(), "cpu_model": model, "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0], "versions": versions,
        # uvicorn's "auto" HTTP parser is httptools when installed, else the pure-Python h11.
        "uvicorn_auto_http_impl": "httptools" if versions["httptools"] else "h11",
    }
