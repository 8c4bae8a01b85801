"""Live role flips on a real cluster (tests/e2e_flip/conftest.py: 2 prefills, 1 decode, tiny-llama): a prefill
flipped to decode under a light stream of requests loses none of them, serves token-exact answers as a decode, and
flips back; each refusal a user can meet answers 409 with its code and changes nothing."""

from __future__ import annotations

import json
import re
import threading

import httpx
import psutil

from tests.e2e.reference import assert_matches
from tests.e2e_flip.conftest import roles
from tests.helpers import CLUSTER_POLL, serving, until

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4, 5,"]
MAX_NEW = 24
OUTCOME = re.compile(r"^(\S+): (\w+) -> (\w+) done: drained in ([\d.]+)s, switched in ([\d.]+)s")


def greedy(text: str, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, **extra}


def streamed(router: httpx.Client, text: str) -> tuple[int, list[int], str]:
    """One streamed /generate: its status, the final output ids and the decode that served it."""
    with router.stream("POST", "/generate", json=greedy(text, stream=True)) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        decode = response.headers.get("x-pdcluster-decode", "")
        if response.status_code != 200 or not lines or lines[-1] != "[DONE]":
            return response.status_code, [], decode
    return 200, json.loads(lines[-2])["output_ids"], decode


class Load:
    """A few clients streaming requests, one after another, until stopped: every answer is kept."""

    def __init__(self, router: httpx.Client, clients: int = 3):
        self.router, self.stop, self.answers = router, threading.Event(), []
        self.threads = [threading.Thread(target=self._client, args=(PROMPTS[i % len(PROMPTS)],), daemon=True)
                        for i in range(clients)]

    def _client(self, text: str) -> None:
        while not self.stop.is_set():
            try:
                self.answers.append((text, *streamed(self.router, text)))
            except httpx.HTTPError as exc:
                self.answers.append((text, -1, [], repr(exc)))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def flipped(result, wid: str, was: str, to: str) -> tuple[float, float]:
    """The CLI's outcome line checked: its exit status, who flipped which way; (drain seconds, switch seconds)."""
    assert result.returncode == 0, (result.stdout, result.stderr)
    match = OUTCOME.match(result.stdout.strip())
    assert match and match.groups()[:3] == (wid, was, to), result.stdout
    return float(match[4]), float(match[5])


def test_a_prefill_flips_to_decode_under_load_loses_nothing_serves_exact_and_flips_back(
        router, registry, reference, ids, switch):
    wid, refs = ids["prefill-1"], {text: reference.greedy(text, MAX_NEW) for text in PROMPTS}
    with Load(router) as load:
        assert until(lambda: len(load.answers) >= 3, 60, CLUSTER_POLL)  # the load runs before the flip
        drain, switched = flipped(switch(wid, "decode"), wid, "prefill", "decode")
        assert roles(registry)[wid] == "decode"
        # The router admits the new decode instance (its canary), and then sends it requests.
        assert until(lambda: any(w["worker_id"] == wid and w["role"] == "decode" and not w["unusable"]
                                 for w in router.get("/ready").json()["workers"]), 60, CLUSTER_POLL)
        during = len(load.answers)
        assert until(lambda: any(a[3] == wid for a in load.answers[during:]), 60, CLUSTER_POLL)
    print(f"\nflip prefill -> decode on tiny-llama: drain {drain:.2f}s, switch {switched:.2f}s")
    assert load.answers and all(status == 200 for _, status, _, _ in load.answers), [
        a for a in load.answers if a[1] != 200][:3]
    for text, _, output, _ in load.answers:  # every answer, before, during and after the flip: exact
        assert_matches(output, refs[text], reference.eos)
    # And plain requests through the flipped worker as the decode, token-exact.
    for text in PROMPTS:
        answer = router.post("/generate", json=greedy(text)).json()
        assert_matches(answer["output_ids"], refs[text], reference.eos)
    drain, switched = flipped(switch(wid, "prefill"), wid, "decode", "prefill")
    print(f"flip decode -> prefill on tiny-llama: drain {drain:.2f}s, switch {switched:.2f}s")
    # decode-0 had served with prefill-1 before its flips: it connects to the new KV manager at once
    # (pdcluster/plugins/flipped_prefill), so the router's canary through that pair admits prefill-1 well within
    # SGLang's 60 s KV timeout, which the canary waited out before.
    assert until(lambda: any(w["worker_id"] == wid and w["role"] == "prefill" and not w["unusable"]
                             for w in router.get("/ready").json()["workers"]), 30, CLUSTER_POLL)


def test_each_refusal_answers_409_with_its_code_and_changes_nothing(router, registry, ids, ask_switch, switch):
    version = registry.get("/v1/workers").json()["version"]
    for name, to, code in (("decode-0", "prefill", "last_of_role"), ("prefill-0", "prefill", "same_role")):
        response = ask_switch(ids[name], to)
        assert response.status_code == 409 and response.json()["error"]["refusal"] == code, response.text
    assert ask_switch("nobody", "decode").status_code == 404
    assert registry.get("/v1/workers").json()["version"] == version
    # The CLI says the same, and exits 1.
    refused = switch(ids["decode-0"], "prefill")
    assert refused.returncode == 1 and "refused (last_of_role)" in refused.stderr
    # One flip at a time: while prefill-1 flips, neither it nor another worker may start one.
    assert ask_switch(ids["prefill-1"], "decode").status_code == 202
    for name in ("prefill-1", "prefill-0"):
        response = ask_switch(ids[name], "decode")
        assert response.status_code == 409 and response.json()["error"]["refusal"] == "switch_running"
    row = {}

    def ended() -> bool:
        nonlocal row
        row = next(w for w in registry.get("/v1/workers").json()["workers"]
                   if w["registration"]["worker_id"] == ids["prefill-1"])
        return (row.get("switch") or {}).get("state") in ("done", "failed")

    assert until(ended, 180, CLUSTER_POLL) and row["switch"]["state"] == "done", row
    flipped(switch(ids["prefill-1"], "prefill"), ids["prefill-1"], "decode", "prefill")



def scheduler_of(cluster, name: str) -> psutil.Process:
    """SGLang's scheduler process of worker `name` (it titles itself sglang::scheduler)."""
    launcher = psutil.Process(cluster.processes[name].popen.pid)
    return next(p for p in launcher.children(recursive=True) if "sglang::scheduler" in " ".join(p.cmdline()))


def test_a_flip_that_fails_half_way_restarts_the_worker_in_its_old_role_and_says_so(
        flip_cluster, router, registry, reference, ids, switch):
    """A decode flipping to prefill tears its KV transfer down before it builds the prefill's, whose ZMQ context
    needs new file descriptors: a scheduler allowed none (its open-files limit lowered under those it holds, which
    stay open) fails that flip half-way, whenever it comes, and nothing earlier (a flip to decode would be refused
    before: SGLang's check of its memory reads /proc). The launcher restarts SGLang in its old role."""
    wid, helper, refs = ids["decode-0"], ids["prefill-1"], {text: reference.greedy(text, MAX_NEW) for text in PROMPTS}
    flipped(switch(helper, "decode"), helper, "prefill", "decode")  # decode-0 is not the last decode now
    before = next(w for w in registry.get("/v1/workers").json()["workers"] if w["registration"]["worker_id"] == wid)
    scheduler = scheduler_of(flip_cluster, "decode-0")
    scheduler.rlimit(psutil.RLIMIT_NOFILE, (3, scheduler.rlimit(psutil.RLIMIT_NOFILE)[1]))
    result = switch(wid, "prefill", wait=240)
    assert result.returncode == 1, (result.stdout, result.stderr)
    row = next(w for w in registry.get("/v1/workers").json()["workers"] if w["registration"]["worker_id"] == wid)
    reason = row["switch"]["reason"]
    assert row["switch"]["state"] == "failed" and reason in result.stderr, (row, result.stderr)
    assert "failed half-way" in reason and "Too many open files" in reason, reason
    assert reason.endswith("the launcher restarted SGLang in its old role (decode)"), reason
    # A new incarnation in its old role, on a new SGLang: the half-switched one is gone.
    assert row["registration"]["role"] == "decode" and not row["draining"], row
    assert row["registration"]["instance_id"] != before["registration"]["instance_id"]
    assert not scheduler.is_running() and scheduler_of(flip_cluster, "decode-0").pid != scheduler.pid
    # prefill-1 back to prefill: decode-0, the only decode again, serves every request, token-exact.
    flipped(switch(helper, "prefill"), helper, "decode", "prefill")
    assert until(lambda: serving(router, wid), 120, CLUSTER_POLL), router.get("/ready").json()
    for text in PROMPTS:
        answer = router.post("/generate", json=greedy(text))
        assert answer.status_code == 200 and answer.headers["x-pdcluster-decode"] == wid, answer.text
        assert_matches(answer.json()["output_ids"], refs[text], reference.eos)
