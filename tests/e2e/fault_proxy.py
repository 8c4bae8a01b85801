"""A worker seen through a proxy that can fail one request on purpose: a retry on a real cluster, on demand.

`FaultProxy(target, faults)` in a thread on 127.0.0.1 passes every request to the worker at `target` and its answer
back, whole (a stream arrives at once, still a valid stream). `faults.arm(status, body)`: the next POST /generate
through any proxy sharing `faults` is passed on and answered by the worker as usual, then its answer is replaced by
that one. The worker did its whole part, and so did the other half of the pair (the KV was handed over): nothing is
left waiting on either, only the router reads a failure. `faults.passing.clear()` holds every POST /generate at the
proxy (a prefill slow to start) until `faults.passing.set()`; `faults.generates` counts them.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tests.helpers import free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Faults:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: list[tuple[int, bytes]] = []
        self.fired = 0
        self.generates = 0  # POST /generate requests that reached a proxy sharing this
        self.passing = threading.Event()  # cleared: each POST /generate is held at the proxy until it is set again
        self.passing.set()

    def arm(self, status: int, body: bytes) -> None:
        with self.lock:
            self.armed.append((status, body))

    def take(self) -> tuple[int, bytes] | None:
        with self.lock:
            if not self.armed:
                return None
            self.fired += 1
            return self.armed.pop(0)


class FaultProxy:
    def __init__(self, target: str, faults: Faults):
        self.target, self.faults = target.rstrip("/"), faults
        self.client = httpx.Client(base_url=self.target, timeout=httpx.Timeout(120))
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the router's clients expect of a worker

            def _pass_on(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.command == "POST" and self.path == "/generate":
                    with proxy.faults.lock:
                        proxy.faults.generates += 1
                    proxy.faults.passing.wait(60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                try:
                    answer = proxy.client.request(self.command, self.path, content=body, headers=headers)
                    status, payload = answer.status_code, answer.content
                    kind = answer.headers.get("content-type", "application/json")
                except httpx.HTTPError as exc:  # the worker is down: so is the proxy, as the router sees it
                    status, payload, kind = 502, repr(exc).encode(), "text/plain"
                if self.command == "POST" and self.path == "/generate" and (fault := proxy.faults.take()):
                    (status, payload), kind = fault, "application/json"
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _pass_on

            def log_message(self, *_args) -> None:
                pass

        return Handler
