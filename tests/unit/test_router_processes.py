"""`workers: 2`: two router processes on one port (python -m router, as users start it) over fake workers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes import FakeWorker, ServerThread
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def router_processes(pid: int) -> list[int]:
    """The router children (multiprocessing's resource tracker, if any, is not one)."""
    return [c for c in children(pid) if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]


def requests_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdcluster_router_requests_total" and s.labels.get("status") == "200")


@contextmanager
def router_over_fakes(tmp_path: Path, config: str, env: dict[str, str] | None = None,
                      decode: FakeWorker | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m router` as users start it, over a fake prefill and a fake decode (`decode`, if given), with the
    `config` lines in its config file: (the process, its URL) once ready; killed on the way out."""
    prefill, decode = FakeWorker(), decode or FakeWorker()
    with ExitStack() as stack:
        p, d = stack.enter_context(ServerThread(prefill.app())), stack.enter_context(ServerThread(decode.app()))
        port = free_port()
        path = tmp_path / "router.yaml"
        path.write_text(f"port: {port}\nbootstrap_url: null\n{config}health_interval: 0.2\n"
                        f"prefill: [{{url: '{p.url}', kv_bootstrap_port: 8999}}]\ndecode: [{{url: '{d.url}'}}]\n")
        proc = subprocess.Popen([sys.executable, "-m", "router", "--config", str(path)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url)
            yield proc, url
        finally:
            proc.kill()
            proc.wait()


@pytest.fixture
def router(tmp_path):
    """`python -m router` with workers: 2 over a fake prefill and decode: (process, URL, decode fake)."""
    decode = FakeWorker()
    with router_over_fakes(tmp_path, "workers: 2\n", decode=decode) as (proc, url):
        yield proc, url, decode


def wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"router did not become ready: {proc.stderr.read().decode()[-2000:]}")


def test_two_processes_serve_one_port_and_their_metrics_add_up(router):
    proc, url, decode = router
    assert len(router_processes(proc.pid)) == 2
    for _ in range(20):  # a new connection each: the kernel spreads them over both processes
        with httpx.Client() as client:
            assert client.post(f"{url}/generate", json={"text": "hi"}).status_code == 200
    assert len(decode.received) == 20
    # Whichever process answers the scrape, the count is the sum over both.
    assert {requests_total(url) for _ in range(6)} == {20}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_a_dead_router_process_stops_the_router_with_an_error_status(router):
    proc, url, _ = router
    first, second = router_processes(proc.pid)
    os.kill(first, signal.SIGKILL)
    assert proc.wait(timeout=30) == 128 + signal.SIGKILL, proc.stderr.read().decode()[-3000:]
    # The other process went with it: nothing is left holding the port.
    assert not Path(f"/proc/{second}").exists() or b"zombie" in Path(f"/proc/{second}/status").read_bytes()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_an_idle_client_connection_outlives_the_clients_own_keep_alive(router):
    """httpx and the openai client drop an idle connection after 5 s. A router closing its side at 5 s too (uvicorn's
    default) races the client's next request on it, which then fails with "Server disconnected without sending a
    response" (seen in CI). The router keeps it longer, so a connection idle for 6 s still answers."""
    _, url, _ = router
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", "/health")
        first = connection.getresponse()
        assert first.status == 200
        first.read()
        sock = connection.sock
        time.sleep(6)
        connection.request("GET", "/health")  # on the same connection: http.client opens none while it has one
        assert connection.sock is sock
        assert connection.getresponse().status == 200
    finally:
        connection.close()


def test_a_request_the_http_parser_refuses_gets_the_json_error(router):
    """A header httptools cannot parse (a `Transfer-Encoding` that is not a coding, found by the schema fuzzer) is
    answered before the app sees the request: in the same JSON error shape as every other 400, not uvicorn's text."""
    _, url, _ = router
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: 0`+ek\r\nContent-Length: 2\r\n\r\n{}")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "not valid HTTP/1.1" in error["message"], error
