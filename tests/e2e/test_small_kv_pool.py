"""A decode whose KV pool is smaller than the model's context, as SGLang sizes it on a machine short of RAM (here:
--max-total-tokens 1536 for a 2048-token context). SGLang 0.5.23 would hold a prompt within its reserve (512 tokens)
of the pool's size in the decode's queue until the prefill's bootstrap timeout (60 s here, 300 s by default) and
then fail it with a 500. Its launcher registers the pool (pdcluster/worker/registrar.py), and the router
(router/pd/kv_fit.py) refuses such a prompt at once with a 400 naming the limit, and serves every prompt within it.

The shared cluster's two decodes are drained meanwhile, so that the small one is the only decode; they are resumed
at the end."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from pdcluster.local.models import DEMO_ARGS
from tests.e2e.conftest import REPO
from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import assert_matches
from tests.helpers import CLUSTER_POLL, serving, until, worker_id

POOL = 1536
RESERVED = 512  # SGLang's num_reserved_decode_tokens
BUDGET = POOL - RESERVED - 1  # page size 1; one page of margin (pdcluster/common/protocol.py, prompt_budget)
IN_THE_GAP = POOL - RESERVED + 1  # SGLang accepts it (< its max_req_input_len, 1530) and would never pre-allocate it


def test_a_prompt_a_small_decode_can_never_hold_is_a_quick_400_and_every_other_is_served(cluster, router, reference,
                                                                                         tmp_path):
    port = cluster.spec.decode.first_port + 60
    wid = f"decode-127.0.0.1-{port}"
    bootstrap = [sys.executable, "-m", "bootstrap", "--url", cluster.spec.bootstrap_url]
    args = [*DEMO_ARGS[:-2], "--max-total-tokens", str(POOL)]  # DEMO_ARGS ends with the demo's own pool size
    assert DEMO_ARGS[-2] == "--max-total-tokens"
    log = open(tmp_path / "small-decode.log", "wb")  # noqa: SIM115 - the child keeps it
    small = subprocess.Popen([sys.executable, "-m", "decode", "--config", str(REPO / "configs" / "decode.yaml"),
                              *args, "--cluster", f"bootstrap_url={cluster.spec.bootstrap_url}", "--port", str(port)],
                             cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    drained = [worker_id(cluster, "decode-0"), worker_id(cluster, "decode-1")]
    try:
        started = until(lambda: serving(router, wid), 300, CLUSTER_POLL)
        assert started, (tmp_path / "small-decode.log").read_text()[-3000:]
        budgets = {w["worker_id"]: w["prompt_budget"] for w in router.get("/ready").json()["workers"]}
        assert budgets[wid] == BUDGET and budgets[drained[0]] is None, budgets
        for other in drained:
            subprocess.run([*bootstrap, "drain", other], check=True, cwd=REPO, timeout=60)
        assert until(lambda: not any(serving(router, w) for w in drained), 30, CLUSTER_POLL)

        # Token ids: the longest prompt the pool takes is served, with the reference's tokens; one more is a 400.
        longest = [(i * 7) % 900 + 3 for i in range(BUDGET)]
        answer = router.post("/generate", json={"input_ids": longest, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-pdcluster-decode"] == wid
        assert_matches(answer.json()["output_ids"], reference.greedy_ids(longest, 4), reference.eos)
        started = time.monotonic()
        refused = router.post("/generate", json={"input_ids": [*longest, 5], "sampling_params": {"max_new_tokens": 4}})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "input_ids"
        assert f"input_ids is {BUDGET + 1} tokens long" in refused.json()["error"]["message"]
        assert f"prompts of at most {BUDGET} tokens" in refused.json()["error"]["message"]
        assert time.monotonic() - started < 10  # not the bootstrap timeout (60 s)
        refused = router.post("/generate", json={"input_ids": [*longest, 5, 6],
                                                 "sampling_params": {"max_new_tokens": 4}})
        assert len(longest) + 2 == IN_THE_GAP and refused.status_code == 400, refused.text

        # Text: counted by the decode's own tokenizer when its bytes may exceed the budget.
        too_long = prompt_of_about(reference.tokenizer, BUDGET + 40)
        tokens = len(reference.tokenizer(too_long)["input_ids"])
        assert tokens > BUDGET
        started = time.monotonic()
        refused = router.post("/generate", json={"text": too_long, "sampling_params": {"max_new_tokens": 4}})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"].startswith(f"text is {tokens} tokens long; ")
        assert time.monotonic() - started < 10
        fits = prompt_of_about(reference.tokenizer, BUDGET - 40)
        assert len(fits.encode()) > BUDGET  # so it is counted, and found to fit
        answer = router.post("/generate", json={"text": fits, "sampling_params": {"max_new_tokens": 4,
                                                                                   "temperature": 0}}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert_matches(answer.json()["output_ids"], reference.greedy(fits, 4), reference.eos)
        chat = router.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": too_long}],
                                                         "max_tokens": 4})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
        assert chat.json()["error"]["message"].startswith("messages is "), chat.text  # counted with its template
    finally:
        for other in drained:
            subprocess.run([*bootstrap, "resume", other], check=False, cwd=REPO, timeout=60)
        small.send_signal(signal.SIGTERM)
        small.wait(timeout=90)
        log.close()
    assert until(lambda: all(serving(router, w) for w in drained), 30, CLUSTER_POLL)
    assert until(lambda: wid not in {w["worker_id"] for w in router.get("/ready").json()["workers"]}, 30, CLUSTER_POLL)
