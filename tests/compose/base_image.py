"""The base image of the Dockerfile, on a machine that can pull none: `FROM debian:<suite>[-slim]` made locally.

A Dockerfile's external bases that are neither present nor pullable (no registry here) are made with
`debootstrap --variant=minbase` from the Debian mirror apt uses, slimmed as Debian's official slim images are, and
`docker import`ed under that name, so `FROM` finds them without pulling.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.compose.engine import Engine, EngineError, _run


def dockerfile_bases(dockerfile: Path, target: str | None) -> list[str]:
    """The external images that building `target` (None: the last stage) starts from or copies from."""
    stages: dict[str, tuple[str, list[str]]] = {}  # name -> (FROM image or stage, COPY --from= sources)
    current = None
    for line in dockerfile.read_text().splitlines():
        if match := re.match(r"\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", line, re.I):
            current = match.group(2) or f"#{len(stages)}"
            stages[current] = (match.group(1), [])
        elif current is not None:
            stages[current][1].extend(re.findall(r"--from=(\S+)", line))
    if not stages:
        raise EngineError(f"{dockerfile} has no FROM")
    bases, todo, seen = set(), [target or list(stages)[-1]], set()
    while todo:
        stage = todo.pop()
        if stage in seen:
            continue
        seen.add(stage)
        if stage not in stages:
            raise EngineError(f"{dockerfile} has no stage {stage!r}")
        base, copies = stages[stage]
        for ref in (base, *copies):
            if ref in stages:
                todo.append(ref)
            elif ref.isdigit():  # COPY --from=<stage index>
                todo.append(list(stages)[int(ref)])
            elif ref != "scratch":
                bases.add(ref)
    return sorted(bases)


def apt_sources(suite: str) -> str:
    """deb822 sources for the image: the host's Debian entries for `suite` (-updates, -security), else Debian's."""
    entries = []
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for block in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", block, re.M))
            suites = [s for s in fields.get("Suites", "").split() if s.split("-")[0] == suite]
            if fields.get("Types", "deb").split()[0] == "deb" and suites and "main" in fields.get("Components", ""):
                entries.append((fields["URIs"].split()[0], suites))
    sources_list = Path("/etc/apt/sources.list")
    if sources_list.is_file():
        for uri, s in re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+.*\bmain\b", sources_list.read_text(), re.M):
            if s.split("-")[0] == suite:
                entries.append((uri, [s]))
    if not entries:
        entries = [("http://deb.debian.org/debian", [suite, f"{suite}-updates"]),
                   ("http://deb.debian.org/debian-security", [f"{suite}-security"])]
    return "\n".join(f"Types: deb\nURIs: {uri}\nSuites: {' '.join(suites)}\nComponents: main\n"
                     f"Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n" for uri, suites in entries)


def debian_mirror(suite: str) -> str:
    if os.environ.get("PDCLUSTER_DEBIAN_MIRROR"):
        return os.environ["PDCLUSTER_DEBIAN_MIRROR"]
    for block in apt_sources(suite).split("\n\n"):
        uri = re.search(r"^URIs: (\S+)", block, re.M)
        if uri and "security" not in uri.group(1):
            return uri.group(1)
    return "http://deb.debian.org/debian"


# What Debian's official slim images leave out (their dpkg path-excludes): documentation, manuals, translations.
SLIM_DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
"""


_CLEAN = "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"
DOCKER_CLEAN = f"""\
DPkg::Post-Invoke {{ "{_CLEAN}"; }};
APT::Update::Post-Invoke {{ "{_CLEAN}"; }};
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"""


def slim_down(rootfs: Path) -> None:
    """What a Debian slim image leaves out, removed now and excluded from every later package install."""
    (rootfs / "etc/dpkg/dpkg.cfg.d/docker-slim").write_text(SLIM_DPKG_EXCLUDES)
    for pattern in ("usr/share/doc/*/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*",
                    "usr/share/groff/*", "usr/share/lintian/*"):
        for path in rootfs.glob(pattern):
            if path.name == "copyright" or not os.path.lexists(path):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def debootstrap_image(engine: Engine, image: str, work_dir: Path) -> None:
    """Makes `debian:<suite>[-slim]` with debootstrap and imports it under that name."""
    match = re.fullmatch(r"(?:docker\.io/)?(?:library/)?debian:([a-z]+)(-slim)?", image)
    if not match:
        raise EngineError(f"{image} cannot be pulled, and only debian:<suite>[-slim] can be made locally")
    suite, slim = match.group(1), bool(match.group(2))
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not os.access(debootstrap, os.X_OK):
        raise EngineError(f"{image} cannot be pulled and debootstrap is not installed: `make setup` installs it")
    if os.geteuid() != 0:
        raise EngineError(f"{image} cannot be pulled, and debootstrap needs root")
    rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work_dir))
    try:
        mirror = debian_mirror(suite)
        _run([debootstrap, "--variant=minbase", suite, str(rootfs), mirror], timeout=900)
        (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
        (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(apt_sources(suite))
        # As in Debian's official images: apt deletes the .deb files it installed (no `apt-get clean` needed).
        (rootfs / "etc/apt/apt.conf.d/docker-clean").write_text(DOCKER_CLEAN)
        if slim:
            slim_down(rootfs)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        proc = subprocess.run([engine.cli, "import", "-c", 'CMD ["bash"]', "-c", "LABEL org.pdcluster.base=debootstrap",
                               "-", image], stdin=tar.stdout, env=engine.env, capture_output=True, timeout=600)
        tar.stdout.close()
        if tar.wait() != 0 or proc.returncode != 0:
            raise EngineError(f"docker import {image} failed: {proc.stderr.decode(errors='replace')[-2000:]}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def ensure_image(engine: Engine, image: str, work_dir: Path) -> str:
    """`image` present in the engine: already there, pulled, or (a Debian base only) made with debootstrap.
    Returns how it was had."""
    if engine.docker("image", "inspect", image, check=False).returncode == 0:
        return "present"
    pull = engine.docker("pull", image, check=False, timeout=900)
    if pull.returncode == 0:
        return "pulled"
    print(f"[engine] {image} cannot be pulled ({pull.stderr.decode(errors='replace').strip()[-300:]}): "
          "making it with debootstrap", file=sys.stderr)
    debootstrap_image(engine, image, work_dir)
    return "debootstrap"
