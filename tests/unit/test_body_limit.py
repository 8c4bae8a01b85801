"""A body over the limit gets a 413 that every client can read, however it sends the body.

A client that sends its whole body before reading (urllib, curl without Expect, scripts) used to find its
connection reset by our close with the body half-sent, and no 413 to read: the router and the bootstrap service now
read and throw away a refused body up to LINGER_FACTOR times the limit (pdcluster/common/http.py), as nginx lingers."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from bootstrap.app import create_app as create_bootstrap
from bootstrap.config import BootstrapConfig
from pdcluster.common.http import LINGER_FACTOR
from tests.fakes import FakeWorker, ServerThread
from tests.unit.test_router_trust import cluster

LIMIT = 2 * 1024 * 1024  # bodies of 2-8x this outgrow the sockets' buffers: the reset would come


def urllib_send(url: str, body: bytes, method: str = "POST") -> tuple[int, bytes]:
    """As a script would: the whole body, `Connection: close`, then the answer."""
    request = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize("times", [2, 4, 8])
def test_urllib_reads_the_413_of_the_router(times):
    with cluster(FakeWorker(), FakeWorker(), max_body_bytes=LIMIT) as url:
        status, body = urllib_send(f"{url}/generate", b"x" * (times * LIMIT))
    assert status == 413 and b"limit" in body


@pytest.mark.parametrize("times", [2, 8])
def test_urllib_reads_the_413_of_the_bootstrap_service(times):
    with ServerThread(create_bootstrap(BootstrapConfig(max_body_bytes=LIMIT))) as service:
        status, body = urllib_send(f"{service.url}/v1/workers/w", b"x" * (times * LIMIT), "PUT")
    assert status == 413 and b"limit" in body


def read_answer(sock: socket.socket) -> bytes:
    """What the router answers, up to the end of its JSON error body or the connection's close."""
    answer = b""
    while b"}}" not in answer:
        data = sock.recv(65536)
        if not data:
            break
        answer += data
    return answer


def raw_exchange(port: int, head: bytes, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        sock.sendall(body)
        return read_answer(sock)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("times", [2, 4, 8])
def test_connection_close_with_the_whole_body_sent_still_reads_the_413(framing, times):
    size = times * LIMIT
    with cluster(FakeWorker(), FakeWorker(), max_body_bytes=LIMIT) as url:
        head = (b"POST /generate HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n" +
                (f"content-length: {size}".encode() if framing == "content-length" else b"transfer-encoding: chunked")
                + b"\r\n\r\n")
        body = b"x" * size if framing == "content-length" else b"%x\r\n%s\r\n0\r\n\r\n" % (size, b"x" * size)
        answer = raw_exchange(int(url.rsplit(":", 1)[1]), head, body)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_client_that_waits_for_100_continue_gets_the_413_without_sending():
    with cluster(FakeWorker(), FakeWorker(), max_body_bytes=LIMIT) as url:
        head = (b"POST /generate HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % (LIMIT * LINGER_FACTOR * 4))
        answer = raw_exchange(int(url.rsplit(":", 1)[1]), head, b"")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_413_reaches_a_kept_alive_client_that_sends_60_mib_without_waiting(chunked):
    size = 60 * 1024 * 1024
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode, max_body_bytes=1024 * 1024) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            framing = b"transfer-encoding: chunked" if chunked else f"content-length: {size}".encode()
            sock.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + framing +
                         b"\r\n\r\n")
            piece = b"x" * (1024 * 1024)
            for _ in range(size // len(piece)):  # all of it, without reading: as curl or a script would
                sock.sendall(b"100000\r\n" + piece + b"\r\n" if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
            answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"limit" in answer


