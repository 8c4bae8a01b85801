"""`python -m pdcluster.kvstore list|clear|verify`: what is stored on disk, checking it, and removing it.

  list  [--dir kv-cache] [--json]                       one line per namespace
  clear [--dir kv-cache] (--namespace FINGERPRINT | --all)   refuses a namespace a running worker uses
  verify [--dir kv-cache] [--namespace FINGERPRINT] [--secret-file F] [--remove]
                                                        every page's seal; what it would remove (exit 1 if any bad)
  launch ...                                            what the worker launcher runs (see launch.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdcluster.kvstore import namespace
from pdcluster.kvstore.page_seal import SECRET_ENV, SecretError, load_secret
from pdcluster.kvstore.verify import verify_namespace


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:
        from pdcluster.kvstore.launch import main as launch

        return launch(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m pdcluster.kvstore", description="The KV cache stored on disk.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="one line per namespace")
    listing.add_argument("--dir", default="kv-cache", help="the kv_store dir of the worker configs")
    listing.add_argument("--json", action="store_true", help="one JSON object per namespace, with its record")
    clear = commands.add_parser("clear", help="delete namespaces no running worker uses")
    clear.add_argument("--dir", default="kv-cache")
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="FINGERPRINT")
    which.add_argument("--all", action="store_true")
    check = commands.add_parser("verify", help="check every stored page's seal; list (or --remove) the bad ones")
    check.add_argument("--dir", default="kv-cache")
    check.add_argument("--namespace", metavar="FINGERPRINT", help="default: every namespace")
    check.add_argument("--secret-file", help=f"the workers' kv_store.secret_file (default: ${SECRET_ENV}, else none)")
    check.add_argument("--remove", action="store_true", help="remove the bad pages (a worker would, at its next read)")
    args = parser.parse_args(argv)
    base = Path(args.dir)
    if not base.is_dir():
        print(f"error: {base} is not a directory", file=sys.stderr)
        return 2
    if args.command == "verify":
        return verify_pages(base, args.namespace, args.secret_file, args.remove)
    return list_namespaces(base, args.json) if args.command == "list" else clear_namespaces(base, args.namespace)


def list_namespaces(base: Path, as_json: bool) -> int:
    rows = namespace.scan(base)
    if as_json:
        for info in rows:
            print(json.dumps({"fingerprint": info.fingerprint, "files": info.files, "bytes": info.bytes,
                              "last_used": info.last_used, "in_use": info.in_use, "record": info.record}))
        return 0
    print(f"{'FINGERPRINT':16}  {'MODEL':24}  {'DTYPE':9}  {'KV DTYPE':9}  {'PAGE':>4}  {'FILES':>7}  {'BYTES':>9}  "
          f"{'LAST USED':19}  STATE")
    for info in rows:
        ident = info.record.get("identity", {})
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.last_used))
        print(f"{info.fingerprint:16}  {str(ident.get('served_model_name'))[:24]:24}  {ident.get('dtype')!s:9}  "
              f"{ident.get('kv_cache_dtype')!s:9}  {ident.get('page_size', '?'):>4}  {info.files:>7}  "
              f"{_human(info.bytes):>9}  {used:19}  {'in use' if info.in_use else 'idle'}")
    return 0


def clear_namespaces(base: Path, fp: str | None) -> int:
    if fp is not None:
        if not namespace.FINGERPRINT.match(fp) or namespace.read_record(base / fp) is None:
            print(f"error: no namespace {fp} in {base} (see: python -m pdcluster.kvstore list --dir {base})",
                  file=sys.stderr)
            return 1
        targets = [base / fp]
    else:
        targets = [info.path for info in namespace.scan(base)]
    status = 0
    for path in targets:
        if namespace.remove(path):
            print(f"removed {path}")
        else:
            print(f"error: {path} is in use by a running worker: stop it first", file=sys.stderr)
            status = 1
    return status


def verify_pages(base: Path, fp: str | None, secret_file: str | None, remove: bool) -> int:
    try:
        secret = load_secret(secret_file)
    except SecretError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    infos = namespace.scan(base)
    if fp is not None:
        infos = [info for info in infos if info.fingerprint == fp]
        if not infos:
            print(f"error: no namespace {fp} in {base} (see: python -m pdcluster.kvstore list --dir {base})",
                  file=sys.stderr)
            return 1
    left = 0
    for info in infos:
        verdict = verify_namespace(info.path, secret, remove)
        for path, reason, gone in verdict.bad:
            print(f"{'removed' if gone else 'could not remove' if remove else 'would remove'} {path} ({reason})")
        reasons = ", ".join(f"{reason}: {count}" for reason, count in verdict.reasons().items()) or "none"
        print(f"{info.path}: {verdict.checked} pages checked, {len(verdict.bad)} bad ({reasons}), "
              f"{verdict.removed} removed")
        left += len(verdict.bad) - verdict.removed
        if verdict.reasons().get("secret") == verdict.checked and verdict.checked:
            print(f"  every page was sealed with another secret than the one given (--secret-file, ${SECRET_ENV})")
    return 1 if left else 0


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return str(size)
