"""Long prompts of a real model must not look like a hang (router/liveness.py).

On 2 CPU cores one SmolLM2 prefill forward pass of a 2000-4000-token prompt takes 10-30 s in silence: no token, no
load snapshot, SGLang's /health waiting. Before the allowance for prompts in flight, the router ejected such a
prefill after stall_timeout (6 s) and ended every request it held (502s, then 503 'no healthy pair'). Here streams
decode while long prompts arrive: every answer is whole, nothing is ejected, and the cluster ends healthy."""

from __future__ import annotations

import threading
import time

from tests.e2e_smollm2.conftest import healthy_workers
from tests.e2e_smollm2.traffic import long_prompt, stream_story


def test_long_prompts_while_streams_decode_eject_nothing_and_fail_nothing(cluster, router, reference):
    problems: list[str] = []

    def stream(i: int) -> None:
        if problem := stream_story(cluster.router_url, i, 48):
            problems.append(problem)

    def long(tokens: int) -> None:
        if problem := long_prompt(cluster.router_url, reference.tokenizer, tokens):
            problems.append(problem)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for tokens in (2000, 4000, 3000):  # one after the other, each arriving while the streams and the others run
        threads.append(threading.Thread(target=long, args=(tokens,)))
        threads[-1].start()
        time.sleep(2)
    for thread in threads:
        thread.join(900)
    assert not any(thread.is_alive() for thread in threads), "a request never finished"
    assert not problems, problems  # both streams whole: 48 tokens each
    router_log = (cluster.log_dir / "router.log").read_text()
    assert "worker hung" not in router_log, [line for line in router_log.splitlines() if "worker hung" in line]
    assert len(healthy_workers(router)) == 2
