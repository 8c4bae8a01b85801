"""How the router runs: one process, or `workers: N` processes sharing the port.

One Python process uses one core at most; a router in front of a GPU rack has more. With workers > 1, each child
binds the port with SO_REUSEPORT (the kernel spreads client connections evenly over them) and runs the whole
router: its own upstream connections, worker pool, health probes, breakers and policy state. Each child sees
1/N of the traffic, so load-aware policies still compare like with like. Prometheus counters and histograms are
summed across children (prometheus_client's multiprocess mode, in a directory this parent owns); per-worker
gauges are sampled by each child every second (in flight: summed; healthy: the minimum; breaker: the maximum).
The parent only supervises: a child that dies takes the router down with its exit status, so the process manager
(compose, systemd) restarts it whole rather than running on with part of its capacity.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from pdcluster.common.children import die_with_parent, exit_status
from pdcluster.common.logs import setup_logging
from router.config import RouterConfig

log = logging.getLogger("pdcluster.router")
STARTUP_FAILURE = 3  # uvicorn's exit status when the app fails to start
# What makes the app a process serves: router.app.create_app, handed over by `python -m router` (router/__main__.py),
# so that this module, which only runs processes, imports none of what they serve.
MakeApp = Callable[[RouterConfig], Any]


def run_process(config: RouterConfig, make_app: MakeApp, sock: socket.socket | None = None) -> int:
    """Run one router process until SIGINT/SIGTERM (uvicorn's graceful shutdown)."""
    import uvicorn

    from pdcluster.common.http_server import JsonErrorHttpTools

    app = make_app(config)
    # The objects made at start-up live for good: keep them out of the collector's way, and collect less often
    # (a relayed request allocates many short-lived objects; measured ~5-10% of the router's CPU at 256 clients).
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
        loop="uvloop", http=JsonErrorHttpTools,  # httptools: the fast pair (bench/README.md)
        timeout_keep_alive=config.keep_alive_timeout,
        proxy_headers=False,  # the router reads no client address; X-Forwarded-* headers are passed on as they are
        # Streams in flight finish first. uvicorn annotates an int, but only hands it to asyncio.wait_for: a float
        # works.
        timeout_graceful_shutdown=max(1.0, config.resolved_grace_period() - 5),  # type: ignore[arg-type]
    ))
    server.run(sockets=[sock] if sock else None)
    return 0 if server.started else STARTUP_FAILURE


def run(config: RouterConfig, make_app: MakeApp) -> int:
    return run_process(config, make_app) if config.workers == 1 else _supervise(config, make_app)


def _reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _child(config_json: str, index: int, make_app: MakeApp) -> None:
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent only; it stops the children once, gracefully
    die_with_parent(signal.SIGTERM)  # never outlive the parent: it owns the metrics directory and the other children
    config = RouterConfig.model_validate_json(config_json)
    setup_logging(f"router-{index}", config.log_level, json_lines=config.log_format == "json")
    sys.exit(run_process(config, make_app, _reuseport_socket(config.host, config.port)))


def _supervise(config: RouterConfig, make_app: MakeApp) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="pdcluster-router-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by prometheus_client when a child imports it
    spawn = multiprocessing.get_context("spawn")
    children = [spawn.Process(target=_child, args=(config.model_dump_json(), i, make_app), name=f"router-{i}")
                for i in range(config.workers)]
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    status = 0
    try:
        for child in children:
            child.start()
        log.info("router processes started", extra={"workers": config.workers, "port": config.port})
        while not stopping:
            ended = wait([c.sentinel for c in children], timeout=0.5)
            if ended and not stopping:
                dead = next(c for c in children if c.sentinel in ended)
                dead.join()
                assert dead.exitcode is not None  # joined
                status = exit_status(dead.exitcode) or 1  # it was not asked to stop: 0 is a failure too
                log.error("router process exited; stopping the others", extra={"router_process": dead.name,
                                                                                "exit_status": status})
                break
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()  # SIGTERM: uvicorn finishes the requests in flight
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
                child.join()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return status
