"""Prepare a worker's KV namespace, then become SGLang (same process, so the launcher's signals reach SGLang).

`python -m pdcluster.kvstore launch --dir D [--role R] [--orphan-tmp-age S] -- python -m sglang.launch_server ...`
is the command the worker launcher runs when `kv_store` is set (it is what `--dry-run` prints). Before SGLang starts:
the fingerprint from the very options SGLang will get, the namespace (record, lock, orphan temp files), and SGLang's
page-hash C++ extension built, so that no client request waits for a compiler. Any failure is one line on stderr and
exit status 2, as for the launcher's own checks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pdcluster.common.config_file import ConfigError
from pdcluster.common.sglang_args import sglang_parser
from pdcluster.kvstore import namespace
from pdcluster.kvstore.fingerprint import DigestCache, fingerprint, kv_identity, weights_identity
from pdcluster.kvstore.page_seal import SecretError, load_secret
from pdcluster.kvstore.secret_proof import MEMBERSHIP_ENV, secret_proof

STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


class LaunchError(Exception):
    pass


def prepare(base: Path, sglang_argv: list[str], orphan_tmp_age: float) -> tuple[dict[str, str], list[str], int, str]:
    """(environment additions, extra SGLang arguments, lock descriptor, a line saying what was done)."""
    ns = sglang_parser().parse_args(sglang_argv)
    base.mkdir(parents=True, exist_ok=True)
    weights, pin = resolve_weights(ns.model_path, ns.revision, DigestCache(base / namespace.DIGEST_CACHE))
    identity = kv_identity(ns, weights)
    fp = fingerprint(identity)
    path, fd, removed = namespace.open_namespace(base, fp, identity, ns.model_path, orphan_tmp_age)
    announce(fp, ns, namespace.store_id(path))
    files = sum(1 for name in os.listdir(path) if name.endswith(".bin"))
    extra = ["--revision", pin] if pin and pin != ns.revision else []
    note = f"KV namespace {path} ({files} pages stored; {removed} orphan temp files removed)"
    return {STORAGE_DIR_ENV: str(path)}, extra, fd, note


def announce(fp: str, ns: argparse.Namespace, store_id: str | None) -> None:
    """Tell the worker launcher, which registers it (pdcluster/worker/registrar.py), the namespace, its directory's
    id and the proof of the secret SGLang's storage will load (its extra config's secret_file, else
    $PDCLUSTER_KV_SECRET): the bootstrap service admits a namespace's workers only with one secret. Decided here,
    from what SGLang really gets."""
    target = os.environ.pop(MEMBERSHIP_ENV, None)
    if not target:
        return  # started by hand, not by a registering launcher
    extra = json.loads(ns.hicache_storage_backend_extra_config or "{}")
    secret = load_secret(extra.get("secret_file") if isinstance(extra, dict) else None)
    Path(target).write_text(json.dumps({"namespace": fp, "secret_proof": secret_proof(secret, fp),
                                        "store_id": store_id}))


def resolve_weights(model_path: str, revision: str | None, cache: DigestCache) -> tuple[dict[str, Any], str | None]:
    """A local folder is known by its content. A hub id by its commit, which SGLang is then pinned to (`--revision`),
    so the weights it downloads are the ones fingerprinted; only config.json is fetched here."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        return weights_identity(local, cache), None
    if model_path.startswith(("/", ".", "~")):
        raise LaunchError(f"model-path {model_path} is not a folder")
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(model_path, revision=revision, allow_patterns=["config.json"]))
    except Exception as exc:  # offline, unknown repo, gated: SGLang would fail the same way
        raise LaunchError(f"cannot resolve model {model_path} to a commit: {type(exc).__name__}: {exc}") from None
    config = weights_identity(snapshot, DigestCache(None))["config_sha256"]
    return {"hub": model_path, "commit": snapshot.name, "config_sha256": config}, snapshot.name


def build_page_hash_extension() -> float:
    """SGLang JIT-compiles its page-hash extension at the first HiCache request; build (or load) it now. Seconds."""
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler):
        raise LaunchError(f"no C++ compiler ({compiler}) for SGLang's page-hash extension: install g++ and "
                          f"libssl-dev (make system-packages)")
    started = time.monotonic()
    try:
        from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

        _load_native_hash_module()
    except Exception as exc:  # the compiler's message is in the chain
        raise LaunchError(f"cannot build SGLang's page-hash extension (needs g++ and OpenSSL headers, "
                          f"libssl-dev): {_root_cause(exc)}") from None
    return time.monotonic() - started


def _root_cause(exc: BaseException) -> str:
    lines: list[str] = []
    link: BaseException | None = exc
    while link is not None:
        lines += [line.strip() for line in str(link).splitlines() if line.strip()]
        link = link.__cause__ or link.__context__
    errors = [line for line in lines if "error:" in line.lower()]
    return (errors or lines or ["unknown error"])[0][:300]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: python -m pdcluster.kvstore launch --dir D [--role R] -- COMMAND", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m pdcluster.kvstore launch")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--role", default="worker")
    parser.add_argument("--orphan-tmp-age", type=float, default=600.0)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    sglang_argv = command[command.index("sglang.launch_server") + 1:] if "sglang.launch_server" in command else []
    try:
        env, extra, fd, note = prepare(Path(args.dir), sglang_argv, args.orphan_tmp_age)
        seconds = build_page_hash_extension()
    except (LaunchError, ConfigError, SecretError, OSError, ValueError) as exc:
        print(f"{args.role}: error: kv_store: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"{args.role}: {note}; page-hash extension ready in {seconds:.1f}s", file=sys.stderr, flush=True)
    os.set_inheritable(fd, True)  # SGLang's main process holds the namespace's shared lock until it exits
    if command[:3] == [sys.executable, "-m", SGLANG_MAIN]:
        return run_sglang_here([*command[3:], *extra], env)
    os.execvpe(command[0], [*command, *extra], {**os.environ, **env})
    return 0  # not reached


SGLANG_MAIN = "sglang.launch_server"


def run_sglang_here(sglang_argv: list[str], env: dict[str, str]) -> int:
    """`python -m sglang.launch_server ...` in this very interpreter: parsing SGLang's options and building the
    extension above imported torch and half of SGLang, which an exec would import again (~10 s of a busy core per
    worker start). What runs is the module SGLang's own command line runs, as `__main__`, so its spawned scheduler and
    detokenizer start as they would under `python -m`."""
    import runpy

    os.environ.update(env)
    sys.argv = [SGLANG_MAIN, *sglang_argv]
    try:
        runpy.run_module(SGLANG_MAIN, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
