"""What a client reads of a worker's refusal: its reason, in the router's error shape, with nothing of the server's
own (a traceback, a path of its files, an internal address); and a text prompt the pair's tokenizer makes nothing
of is a 400 before any worker generates."""

from __future__ import annotations

import json

import httpx
import pytest

from router.app import create_app
from router.config import RouterConfig
from router.pd.failures import clean_reason, worker_reason
from router.service import PdService
from tests.fakes import Behaviour, FakeWorker, ServerThread
from tests.unit.test_router_pd import cluster

SGLANG_400 = "\n".join([
    "1 validation error:", "  {'loc': ('body', 'max_tokens'), 'msg': 'Value error'}",
    "Traceback (most recent call last):",
    '  File "/opt/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/http_server.py", line 990, in generate',
    "    raise ValueError(msg)", "ValueError: max_tokens must be positive"])


@pytest.mark.parametrize(("message", "kept", "gone"), [
    (SGLANG_400, "1 validation error", ["Traceback", "site-packages", "line 990", "/opt/"]),
    ("KV transfer to 10.0.3.7:8999 failed (http://decode-3:30200/x)", "KV transfer to", ["10.0.3.7", "decode-3"]),
    ("cannot open /var/lib/pdcluster/kv-cache/abc/page.bin", "cannot open", ["/var/lib", "page.bin"]),
    ("prompt is too long: 9000 > 8192 tokens, and/or bad", "9000 > 8192 tokens, and/or bad", []),
    ("x" * 2000, "x" * 100, ["x" * 600]),
])
def test_a_reason_keeps_the_words_and_loses_the_servers_own(message, kept, gone):
    reason = clean_reason(message)
    assert kept in reason and "\n" not in reason
    for secret in gone:
        assert secret not in reason


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"object": "error", "message": "max_tokens must be positive", "code": 400}', "max_tokens must be positive"),
    (b'{"error": {"message": "bad grammar"}}', "bad grammar"),
    (b'{"error": "plain"}', "plain"),
    (b"<html>nginx</html>", ""), (b"", ""), (b'{"error": {"no": "message"}}', ""), (b"[1]", ""),
])
def test_the_reason_is_read_from_each_of_sglangs_shapes(body, reason):
    assert worker_reason(body) == reason


def test_a_workers_400_reaches_the_client_in_the_routers_shape():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(status=400, error_message=SGLANG_400))
    with cluster(prefill, decode, max_attempts=1) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "a"}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["message"].startswith("decode ") and "max_tokens must be positive" in error["message"]
    assert "Traceback" not in response.text and "site-packages" not in response.text


def test_a_workers_error_event_mid_stream_is_rewritten():
    prefill, decode = FakeWorker(), FakeWorker(Behaviour(chunks=2, error_event=SGLANG_400))
    with cluster(prefill, decode) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "a", "stream": True}, timeout=30)
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events[:2]] == ["x", "x"]
    error = events[2]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert "max_tokens must be positive" in error["message"] and "site-packages" not in response.text


def test_a_text_the_tokenizer_makes_nothing_of_is_refused_naming_the_item():
    """The fake tokenizer counts a token per two characters: one zero-width space is 0 tokens, as a normalizing
    tokenizer without BOS would make it. Ordinary texts are never counted."""
    prefill, decode = FakeWorker(), FakeWorker()
    with cluster(prefill, decode) as url:
        refused = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ["ab", "\u200b"]}, timeout=30)
        served = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ["ab", "cd"]}, timeout=30)
        counted = httpx.post(f"{url}/generate", json={"text": "\u200b\u200b"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt[1]"
    assert "no token" in refused.json()["error"]["message"]
    assert served.status_code == 200 and counted.status_code == 200
    assert decode.tokenized == [{"prompt": ["\u200b"]}, {"prompt": ["\u200b\u200b"]}]
    assert len(decode.received) == 2  # the refused one never reached a worker


def test_a_defect_of_the_routers_is_still_a_json_error(monkeypatch):
    monkeypatch.setattr(PdService, "routes", lambda self: {"/generate": _raising})
    with ServerThread(create_app(RouterConfig(bootstrap_url=None))) as server:
        response = httpx.post(f"{server.url}/generate", json={"text": "a"}, timeout=30)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == 500 and "a defect" not in response.text


async def _raising(request):
    raise RuntimeError("a defect")
