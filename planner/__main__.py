"""`python -m planner [--config configs/planner.yaml] [--host H] [--port P] [--mode recommend|act] [--dry-run]`:
the live planner (planner/live.py), one decision per interval, its metrics on its own port (/metrics; /health for
the probes)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app

from pdcluster.common.config_file import fail, load_model
from pdcluster.common.logs import setup_logging
from pdcluster.common.stopping import stop_requested


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # a line per scrape is noise


def serve(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """/metrics (and any other path: prometheus_client's app) and /health, in a daemon thread."""
    metrics = make_wsgi_app(registry)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/health":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        return metrics(environ, start_response)

    server = make_server(host, port, app, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="planner-metrics", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    import httpx
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
    planner = LivePlanner(config, profile, httpx.Client(timeout=10))
    server = serve(config.host, config.port, planner.metrics.registry)
    stopping = stop_requested()
    logging.getLogger("pdcluster.planner").info(
        f"planner: mode {config.mode}, one decision every {config.interval_s:.0f}s, profile {profile.model}; "
        f"reading {config.router_url} and {config.bootstrap_url}; metrics on http://{config.host}:{config.port}")
    try:
        planner.run(stopping)
    finally:
        server.shutdown()
        planner.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
