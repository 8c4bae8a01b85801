"""SGLang's own benchmark client (`sglang.bench_serving`) is served by the router as it is.

bench_serving spells out defaults (`"lora_path": null`, `"return_routed_experts": false`) of fields the router
refuses; the router once answered its every request with a 400, and `make bench-cluster` measured nothing. Here the
payloads are the ones SGLang's own request functions build (captured from them, with the command line's defaults),
not a copy of them, so an SGLang upgrade that adds a field to them shows up here."""

from __future__ import annotations

import asyncio
import sys

import pytest
from sglang.benchmark import serving

from pdcluster.common.http import ApiError
from router.checks.validation import check_chat, check_completion, check_generate


class _Captured(Exception):
    pass


class _Session:
    """Stands in for bench_serving's aiohttp session: records the body, then fails the request (which
    bench_serving records as a failed request and returns)."""

    def __init__(self, sink: list) -> None:
        self.sink = sink

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    def post(self, url, json=None, headers=None, **kwargs):
        self.sink.append((url, json))
        raise _Captured


def _default_args(monkeypatch, *argv: str):
    parsed = []
    monkeypatch.setattr(serving, "run_benchmark", parsed.append)
    monkeypatch.setattr(sys, "argv", ["bench_serving", "--model", "m", *argv])
    serving.cli_main()
    return parsed[0]


def _payload(monkeypatch, backend: str, prompt, *argv: str) -> dict:
    serving.set_global_args(_default_args(monkeypatch, "--backend", backend, *argv))
    sink: list = []
    monkeypatch.setattr(serving, "_create_bench_client_session", lambda: _Session(sink))
    path = "/v1/chat/completions" if backend.endswith("chat") else "/v1/completions"  # the URL is checked
    request = serving.RequestFuncInput(prompt=prompt, api_url=f"http://127.0.0.1:1{path}", prompt_len=3, output_len=8,
                                       model="m", lora_name=None, image_data=None, extra_request_body={})
    asyncio.run(serving.ASYNC_REQUEST_FUNCS[backend](request))
    assert len(sink) == 1
    return sink[0][1]


@pytest.mark.parametrize("argv", [(), ("--disable-stream",)], ids=["streamed", "plain"])
@pytest.mark.parametrize("prompt", ["The capital of France is", [1, 2, 3]], ids=["text", "ids"])
def test_bench_serving_generate_payload_is_accepted_and_its_defaults_not_sent(monkeypatch, prompt, argv):
    body = _payload(monkeypatch, "sglang", prompt, *argv)
    assert body["lora_path"] is None and body["return_routed_experts"] is False  # what the router once refused
    checked = check_generate(body)
    assert "lora_path" not in body and "return_routed_experts" not in body
    assert body["sampling_params"]["max_new_tokens"] == 8 and checked.stream is ("--disable-stream" not in argv)


def test_bench_serving_openai_payloads_are_accepted(monkeypatch):
    check_completion(_payload(monkeypatch, "sglang-oai", "The capital of France is"))
    chat = _payload(monkeypatch, "sglang-oai-chat", [{"role": "user", "content": "What is the capital of France?"}])
    check_chat(chat)


def test_asking_for_what_a_refused_field_does_is_still_refused(monkeypatch):
    body = _payload(monkeypatch, "sglang", "The capital of France is", "--return-routed-experts")
    with pytest.raises(ApiError) as caught:
        check_generate(body)
    assert caught.value.status == 400 and caught.value.param == "return_routed_experts"
