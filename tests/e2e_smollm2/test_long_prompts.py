"""Long prompts of a real model must not look like a hang (router/liveness.py).

On 2 CPU cores one SmolLM2 prefill forward pass of a 2000-4000-token prompt takes 10-30 s in silence: no token, no
load snapshot, SGLang's /health waiting. Before the allowance for prompts in flight, the router ejected such a
prefill after stall_timeout (6 s) and ended every request it held (502s, then 503 'no healthy pair'). Here streams
decode while long prompts arrive: every answer is whole, nothing is ejected, and the cluster ends healthy."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.e2e.prompts import prompt_of_about
from tests.e2e_smollm2.conftest import healthy_workers


def test_long_prompts_while_streams_decode_eject_nothing_and_fail_nothing(cluster, router, reference):
    problems: list[str] = []
    streamed: list[int] = []

    def stream(i: int) -> None:
        body = {"text": f"Write a long story about the number {i}.", "stream": True,
                "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(base_url=cluster.router_url, timeout=600) as client, client.stream(
                "POST", "/generate", json=body) as response:
            events = [line for line in response.iter_lines() if line.startswith("data:")]
        if response.status_code != 200 or events[-1] != "data: [DONE]" or any('"error"' in e for e in events):
            problems.append(f"stream {i}: {response.status_code} {events[-2:]}")
        else:
            streamed.append(json.loads(events[-2].removeprefix("data: "))["meta_info"]["completion_tokens"])

    def long_prompt(tokens: int) -> None:
        body = {"text": prompt_of_about(reference.tokenizer, tokens), "sampling_params": {"max_new_tokens": 4}}
        with httpx.Client(base_url=cluster.router_url, timeout=900) as client:
            response = client.post("/generate", json=body)
        if response.status_code != 200 or response.json()["meta_info"]["completion_tokens"] != 4:
            problems.append(f"{tokens}-token prompt: {response.status_code} {response.text[:300]}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for tokens in (2000, 4000, 3000):  # one after the other, each arriving while the streams and the others run
        threads.append(threading.Thread(target=long_prompt, args=(tokens,)))
        threads[-1].start()
        time.sleep(2)
    for thread in threads:
        thread.join(900)
    assert not problems, problems
    assert streamed == [48, 48]
    router_log = (cluster.log_dir / "router.log").read_text()
    assert "worker hung" not in router_log, [line for line in router_log.splitlines() if "worker hung" in line]
    assert len(healthy_workers(router)) == 2
