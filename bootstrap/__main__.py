"""`python -m bootstrap [--config configs/bootstrap.yaml]` runs the service; `python -m bootstrap status` lists it;
`python -m bootstrap drain WORKER_ID` takes a worker out of the routers' pools without stopping it, and `resume
WORKER_ID` puts it back; `switch WORKER_ID --to prefill|decode [--wait SECONDS]` flips its role live."""

from __future__ import annotations

import argparse
import sys

from pdcluster.common.config_file import load_model


def main(argv: list[str] | None = None) -> int:
    from bootstrap.config import BootstrapConfig

    parser = argparse.ArgumentParser(prog="python -m bootstrap")
    parser.add_argument("command", nargs="?", choices=["serve", "status", "drain", "resume", "switch"], default="serve")
    parser.add_argument("worker_id", nargs="?", help="for drain, resume, switch: the worker's id (see status)")
    parser.add_argument("--to", choices=["prefill", "decode"], help="for switch: the worker's new role")
    parser.add_argument("--wait", type=float, default=180.0, help="for switch: seconds to follow the flip")
    parser.add_argument("--config", help="YAML file with the bootstrap service's settings")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--url", help="for status, drain, resume, switch: the service's URL (default: from the config)")
    parser.add_argument("--dry-run", action="store_true", help="validate the config, print it, and exit")
    args = parser.parse_args(argv)
    config = load_model(BootstrapConfig, args.config, {"host": args.host, "port": args.port}, prog="bootstrap")
    if args.dry_run:
        print(config.model_dump_json(indent=2))
        return 0
    url = args.url or f"http://{config.host}:{config.port}"
    if args.command == "status":
        from bootstrap.status import print_status

        return print_status(url)
    if args.command in ("drain", "resume"):
        from bootstrap.status import set_draining

        if not args.worker_id:
            parser.error(f"{args.command} needs a worker id")
        return set_draining(url, args.worker_id, args.command == "drain", config.resolved_token())
    if args.command == "switch":
        from bootstrap.status import switch_role

        if not args.worker_id or not args.to:
            parser.error("switch needs a worker id and --to prefill|decode")
        return switch_role(url, args.worker_id, args.to, config.resolved_token(), args.wait)

    import uvicorn

    from bootstrap.app import create_app
    from pdcluster.common.http_server import JsonErrorHttpTools

    server: uvicorn.Server | None = None
    app = create_app(config, shutting_down=lambda: server is not None and server.should_exit)
    # Long-polls are cut short on shutdown: routers then keep their last listing until the service is back.
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                          access_log=False, timeout_graceful_shutdown=1,
                                          http=JsonErrorHttpTools))
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
