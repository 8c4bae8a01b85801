"""A worker pinned to its own core (cluster.cpus) serves and never stalls.

The regime PD exists for on one host: the prefill on one core, the decode on the other, each SGLang tree pinned with
its torch threads sized to its core. Pinned with SGLang's default threads (two per worker on one core each), a decode
once held 4 running requests without a token for 4.5 minutes. Here: both workers restarted pinned, their processes
checked (affinity, OMP_NUM_THREADS), then streams decode while a long prompt prefills, and every answer is whole,
in the tokens of the unpinned run, with no long silence between a stream's tokens. Runs last in its suite (the
workers stay pinned until the suite's cluster stops): tests/conftest.py.

The restart is also the one a KV store is for: a prompt stored before it is read back from disk after it (the
prefill's memory is empty), with the same answer. One restart for both checks: each costs a SmolLM2 start.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from tests.e2e_smollm2.conftest import PREFILL_PORT, healthy_workers
from tests.e2e_smollm2.traffic import assert_read_from_the_store, long_prompt, store_a_prompt, stream_story
from tests.helpers import until

MAX_SILENCE_S = 60.0  # a decode step on one core takes ~0.2 s; a whole 2000-token prefill on the other, ~20 s


def restart_pinned(cluster, router, cores: dict[str, int]) -> None:
    """Both workers stopped, then started pinned together: one SGLang start's wait, not two in a row."""
    processes = {name: cluster.processes[name] for name in cores}
    for process in processes.values():
        process.signal(signal.SIGTERM)
    for name, process in processes.items():
        process.popen.wait(timeout=120)
        process.command = [*process.command, "--cluster", f"cpus={cores[name]}"]
        process.start()
    assert until(lambda: len(healthy_workers(router)) == 2 or not all(p.running for p in processes.values()), 600,
                 0.5), [p.tail(40) for p in processes.values()]
    for name, process in processes.items():
        assert process.running, f"{name} exited after its pinned restart:\n{process.tail(40)}"


def sglang_tree(launcher_pid: int) -> list[psutil.Process]:
    return psutil.Process(launcher_pid).children(recursive=True)  # the launcher itself stays unpinned


def test_pinned_prefill_and_decode_serve_streams_and_a_long_prompt_without_stalling(cluster, router, reference,
                                                                                   kv_dir):
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, f"this test pins the prefill and the decode to a core each; only {cores} available"
    body = {"text": "Tell me about the sea.", "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
    unpinned = router.post("/generate", json=body).json()["output_ids"]
    stored = store_a_prompt(router, reference, kv_dir)

    pinned = {"prefill-0": cores[0], "decode-0": cores[1]}
    restart_pinned(cluster, router, pinned)
    assert_read_from_the_store(router, reference, stored)
    for name, core in pinned.items():
        launcher = psutil.Process(cluster.processes[name].popen.pid)
        tree = sglang_tree(launcher.pid)
        assert tree, f"{name}: no SGLang process under its launcher"
        for process in tree:
            assert process.cpu_affinity() == [core], (name, process.name(), process.cpu_affinity())
        # SGLang's own children inherit its environment but retitle themselves (setproctitle), which blanks what
        # /proc shows of it: the environment is read where the launcher started SGLang.
        [sglang] = launcher.children()
        assert sglang.environ().get("OMP_NUM_THREADS") == "1", (name, sglang.name(), sglang.cmdline()[:4])
    assert f"prefill-127.0.0.1-{PREFILL_PORT}" in healthy_workers(router)
    assert router.post("/generate", json=body).json()["output_ids"] == unpinned  # same tokens, pinned or not

    problems: list[str] = []
    silences: list[float] = []

    def stream(i: int) -> None:
        if problem := stream_story(cluster.router_url, i, 64, silences):
            problems.append(problem)

    def long() -> None:
        if problem := long_prompt(cluster.router_url, reference.tokenizer, 2000):
            problems.append(problem)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2)  # the streams are decoding when the long prompt arrives
    threads.append(threading.Thread(target=long))
    threads[-1].start()
    for thread in threads:
        thread.join(900)
    assert not any(thread.is_alive() for thread in threads), "a request never finished"
    assert not problems, problems
    assert max(silences) < MAX_SILENCE_S, f"a stream went {max(silences):.1f} s without a token"
    assert len(healthy_workers(router)) == 2
