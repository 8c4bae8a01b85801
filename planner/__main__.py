"""`python -m planner [--config configs/planner.yaml] [--host H] [--port P] [--mode recommend|act] [--dry-run]`:
the live planner (planner/live.py), one decision per interval, its metrics on its own port (/metrics)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from pdcluster.common.config_file import fail, load_model
from pdcluster.common.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    import httpx
    from prometheus_client import start_http_server
    from pydantic import ValidationError

    from pdcluster.common.capacity import Profile
    from planner.config import PlannerConfig
    from planner.live import LivePlanner

    parser = argparse.ArgumentParser(prog="python -m planner")
    parser.add_argument("--config", help="YAML file with the planner's settings (configs/planner.yaml)")
    parser.add_argument("--host", help="where its /metrics listens")
    parser.add_argument("--port", type=int)
    parser.add_argument("--mode", choices=["recommend", "act"])
    parser.add_argument("--router-url")
    parser.add_argument("--bootstrap-url")
    parser.add_argument("--dry-run", action="store_true", help="validate the config and its profile, print the "
                                                               "config, and exit")
    args = parser.parse_args(argv)
    config = load_model(PlannerConfig, args.config,
                        {"host": args.host, "port": args.port, "mode": args.mode, "router_url": args.router_url,
                         "bootstrap_url": args.bootstrap_url}, prog="planner")
    try:
        profile = Profile.load(config.profile)
    except (OSError, ValueError, ValidationError) as exc:
        fail("planner", f"profile {config.profile}: {exc}")
    if args.dry_run:
        print(config.model_dump_json(indent=2, exclude={"token"}))
        return 0
    setup_logging("planner", config.log_level)
    server, _ = start_http_server(config.port, config.host, registry=(planner := LivePlanner(
        config, profile, httpx.Client(timeout=10))).metrics.registry)
    stopping = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    logging.getLogger("pdcluster.planner").info(
        f"planner: mode {config.mode}, one decision every {config.interval_s:.0f}s, profile {profile.model}; "
        f"reading {config.router_url} and {config.bootstrap_url}; metrics on http://{config.host}:{config.port}")
    try:
        planner.run(lambda: stopping)
    finally:
        server.shutdown()
        planner.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
