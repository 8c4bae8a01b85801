"""`python prefill.py|decode.py --config FILE [--dry-run] [--sglang-option value ...]`.

Every way to start a worker (`python prefill.py`, `python -m prefill`, the `pdcluster-prefill` script) ends here, with
the role's rules (`prefill/plan.py` or `decode/plan.py`) passed in by the role's own entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from pdcluster.common.config_file import ConfigError
from pdcluster.common.logs import setup_logging

if TYPE_CHECKING:
    from pdcluster.common.protocol import RoleSwitch
    from pdcluster.worker.plan import LaunchPlan, RoleRules

log = logging.getLogger("pdcluster.worker")

PLAN_ENV = "PDCLUSTER_LAUNCH_PLAN"  # the decided plan, handed to the lean launcher (main -> exec -> _lean_main)


def main(rules: RoleRules, argv: list[str] | None = None) -> int:
    role = rules.ROLE
    parser = argparse.ArgumentParser(
        prog=_prog(role.value),
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
        plan = build_plan(rules, args.config, overrides, cluster_overrides=_key_values(args.cluster))
    except ConfigError as exc:
        print(f"{role.value}: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(plan.describe())
        return 0
    # Deciding the plan imported SGLang's argument parser, and with it torch: ~0.8 GB that this process would keep
    # for the worker's whole life while it only supervises. It becomes a fresh interpreter instead (same pid, so
    # signals and exit statuses are unchanged) that gets the plan and nothing else. The original command line stays
    # visible after `--as`.
    os.environ[PLAN_ENV] = plan.to_json()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "pdcluster.worker.cli", "--as", *sys.argv])
    return 0  # not reached


def run_plan(plan: LaunchPlan) -> int:
    """Supervise SGLang as `plan` says: register it, heartbeat, forward stop signals; SGLang's exit status."""
    from pdcluster.worker.registrar import Registrar
    from pdcluster.worker.supervisor import Supervisor

    role = plan.role
    log.info("starting SGLang %s%s: %s", role.value, " (CPU profile)" if plan.cpu else "", plan.describe())
    from pdcluster.worker.role_flip import RoleFlip

    supervisor: Supervisor | None = None
    registrar: Registrar | None = None

    def flip(order: RoleSwitch) -> None:  # a role flip in a thread of its own; a failed one restarts SGLang
        if registrar is not None and supervisor is not None:
            RoleFlip(registrar, order, supervisor.restart, supervisor.mid_flip).start()

    registrar = Registrar(plan, on_flip=flip) if plan.cluster.bootstrap_url else None
    env = {**plan.env, **registrar.child_env()} if registrar else plan.env
    supervisor = Supervisor(plan.command, env, plan.cluster.resolved_grace_period(),
                            on_stop=registrar.leave_pools if registrar else lambda: None,
                            on_restart=registrar.adopt if registrar else lambda proc: None)
    code = supervisor.run(while_running=registrar.start if registrar else None)
    if registrar:
        registrar.stop()
    log.info("SGLang %s exited with status %s", role.value, code)
    return code


def _prog(role: str) -> str:
    """How the user started it: `prefill.py`, `pdcluster-prefill`, or `python -m prefill` (argv[0]: __main__.py)."""
    name = os.path.basename(sys.argv[0])
    return f"python -m {role}" if name in ("__main__.py", "", "-c") else name


def _key_values(pairs: list[str]) -> dict[str, str | None]:
    result = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"--cluster expects KEY=VALUE, got {pair!r}")
        result[key.strip()] = None if value.lower() in ("", "none", "null") else value
    return result


def _lean_main() -> int:
    """`python -m pdcluster.worker.cli --as <the original command line>`: what main() execs itself into."""
    from pdcluster.worker.plan import LaunchPlan

    plan = LaunchPlan.from_json(os.environ.pop(PLAN_ENV))
    setup_logging(plan.role.value, "info", json_lines=False)
    return run_plan(plan)


if __name__ == "__main__":
    sys.exit(_lean_main())
