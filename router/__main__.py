"""`python -m router [--config configs/router.yaml] [--host H] [--port P]`."""

from __future__ import annotations

import argparse
import sys

from pdcluster.common.config_file import load_model
from pdcluster.common.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    from router.config import RouterConfig
    from router.pd.policies import REGISTRY

    parser = argparse.ArgumentParser(prog="python -m router")
    parser.add_argument("--config", help="YAML file with the router's settings")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--bootstrap-url")
    parser.add_argument("--workers", type=int, help="router processes sharing the port")
    parser.add_argument("--dry-run", action="store_true", help="validate the config, print it, and exit")
    args = parser.parse_args(argv)
    config = load_model(RouterConfig, args.config,
                        {"host": args.host, "port": args.port, "bootstrap_url": args.bootstrap_url,
                         "workers": args.workers}, prog="router", context={"policies": REGISTRY})
    if args.dry_run:
        print(config.model_dump_json(indent=2))
        return 0
    setup_logging("router", config.log_level, json_lines=config.log_format == "json")

    from router.app import create_app
    from router.processes import run

    return run(config, create_app)


if __name__ == "__main__":
    sys.exit(main())
