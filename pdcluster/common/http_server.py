"""The HTTP/1.1 protocol our servers run: uvicorn's httptools protocol, with its one answer that bypasses the app
(a request the parser refuses: a malformed request line, header or `Transfer-Encoding`) in the JSON error shape
every other answer has, so that a client or gateway that reads our errors reads this one too."""

from __future__ import annotations

import inspect

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pdcluster.common.http import error_body

UNPARSABLE = "the request is not valid HTTP/1.1: its request line or a header could not be parsed"


def _check_adapted() -> None:
    """Refuse to start on a uvicorn whose protocol no longer sends its parser's 400 through this method."""
    method = getattr(HttpToolsProtocol, "send_400_response", None)
    source = inspect.getsource(HttpToolsProtocol.data_received) if method else ""
    if method is None or list(inspect.signature(method).parameters) != ["self", "msg"] \
            or "self.send_400_response(" not in source:
        raise RuntimeError("uvicorn's HttpToolsProtocol changed: pdcluster.common.http_server no longer adapts it")


class JsonErrorHttpTools(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:  # uvicorn's text is replaced, not relayed
        body = orjson.dumps(error_body(400, UNPARSABLE))
        head = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.extend([b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n", b"\r\n", body])
        self.transport.write(b"".join(head))
        self.transport.close()


_check_adapted()
