"""Print the pip requirements of one image target, one per line, from pyproject.toml alone.

    python requirements.py pyproject.toml cpu     # dependencies + the `cpu` extra (+ the build backend)

docker/Dockerfile installs these in a layer of its own, before the code is copied: the layer's cache key is this
output, so a code change, or a pyproject.toml change elsewhere (the test extra, a version bump of the package), does
not reinstall torch. The build backend (setuptools) is included so that the code layer installs with
--no-build-isolation, offline.
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: dict, extra: str) -> list[str]:
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    if extra not in extras:
        raise SystemExit(f"pyproject.toml has no [project.optional-dependencies] {extra!r}: {sorted(extras)}")
    return [*pyproject["build-system"]["requires"], *project["dependencies"], *extras[extra]]


if __name__ == "__main__":
    path, extra = sys.argv[1:]
    with open(path, "rb") as f:
        print("\n".join(requirements(tomllib.load(f), extra)))
