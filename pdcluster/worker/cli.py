"""`python prefill.py|decode.py --config FILE [--dry-run] [--sglang-option value ...]`."""

from __future__ import annotations

import argparse
import logging
import sys

from pdcluster.config_file import ConfigError
from pdcluster.logs import setup_logging
from pdcluster.protocol import Role


def main(role: Role, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{role.value}.py",
        allow_abbrev=False,  # SGLang's flags share prefixes with ours; never guess which one was meant
        description=f"Start an SGLang {role.value} worker of a pdcluster. Any other --option is SGLang's.",
    )
    parser.add_argument("--config", help="YAML file: SGLang option names, plus a `cluster:` section")
    parser.add_argument("--dry-run", action="store_true", help="print the SGLang command and environment, then exit")
    parser.add_argument("--cluster", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of the config's cluster: section (repeatable)")
    args, overrides = parser.parse_known_args(argv)
    setup_logging(role.value, "info", json_lines=False)  # interleaved with SGLang's own text lines

    from pdcluster.worker.plan import build_plan  # after argparse, so --help stays instant

    try:
        plan = build_plan(role, args.config, overrides, cluster_overrides=_key_values(args.cluster))
    except ConfigError as exc:
        print(f"{role.value}: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(plan.describe())
        return 0

    from pdcluster.worker.registrar import Registrar
    from pdcluster.worker.supervisor import Supervisor

    logging.info("starting SGLang %s%s: %s", role.value, " (CPU profile)" if plan.cpu else "", plan.describe())
    registrar = Registrar(plan) if plan.cluster.bootstrap_url else None
    code = Supervisor(plan.command, plan.env).run(while_running=registrar.start if registrar else None)
    if registrar:
        registrar.stop()
    logging.info("SGLang %s exited with status %s", role.value, code)
    return code


def _key_values(pairs: list[str]) -> dict[str, str | None]:
    result = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"--cluster expects KEY=VALUE, got {pair!r}")
        result[key.strip()] = None if value.lower() in ("", "none", "null") else value
    return result
