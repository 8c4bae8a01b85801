"""A prompt's KV written to disk is served from there after the cluster restarts, gracefully or after a SIGKILL,
and the answer is token for token what transformers computes without any cache. And a worker with a KV store cannot
be flipped to the other role (its shape is this file's: no restart for it)."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx

from tests.e2e.reference import assert_matches
from tests.e2e_persistence.conftest import PAGE, REPO, greedy_ids, prompt_ids

MAX_NEW = 32


def test_whole_cluster_restart_serves_a_long_prompt_and_a_shared_prefix_from_disk(pc, reference):
    pc.ensure()
    tok = reference.tokenizer
    prompt = prompt_ids(tok, "whole-restart", 600)
    base = prompt_ids(tok, "shared-prefix-base", 600)
    shared = base[:320] + prompt_ids(tok, "shared-prefix-tail", 281)[1:]  # 600 tokens, the first 320 as `base`
    ref = greedy_ids(reference, prompt, MAX_NEW)

    pages = pc.pages()
    cold = pc.generate(prompt, MAX_NEW)
    assert cold.cached == 0, cold  # a fresh KV directory: nothing to reuse
    assert_matches(cold.output_ids, ref, reference.eos)
    pc.generate(base, 4)
    assert pc.wait_pages(pages + 2 * (600 // PAGE)) >= pages + 2 * (600 // PAGE)

    pc.restart_all()  # every process SIGTERMed, then started again: no device or host memory survives

    warm = pc.generate(prompt, MAX_NEW)
    assert warm.cached >= 512 and warm.storage >= 512, warm
    assert warm.output_ids == cold.output_ids
    assert_matches(warm.output_ids, ref, reference.eos)

    partial = pc.generate(shared, MAX_NEW)  # no device of the restarted cluster holds `base`: all from disk
    assert partial.cached >= 256 and partial.storage >= 256, partial
    assert partial.cached <= 320, partial  # whole pages of the shared prefix only, never beyond it
    assert_matches(partial.output_ids, greedy_ids(reference, shared, MAX_NEW), reference.eos)


def test_prefill_killed_with_sigkill_and_restarted_alone_serves_from_disk(pc, reference):
    pc.ensure()
    prompt = prompt_ids(reference.tokenizer, "sigkill", 600)
    ref = greedy_ids(reference, prompt, MAX_NEW)
    pages = pc.pages()
    first = pc.generate(prompt, MAX_NEW)
    assert_matches(first.output_ids, ref, reference.eos)
    pc.wait_pages(pages + 600 // PAGE)
    decode = pc.local.processes["decode-0"].popen.pid

    pc.restart([first.prefill], signal.SIGKILL)  # its whole process tree, SGLang's schedulers included

    assert pc.local.processes["decode-0"].popen.pid == decode and pc.local.processes["decode-0"].running
    again = pc.generate(prompt, MAX_NEW)
    assert again.prefill == first.prefill
    assert again.cached >= 512 and again.storage >= 512, again
    assert again.output_ids == first.output_ids
    assert_matches(again.output_ids, ref, reference.eos)


def test_a_worker_keeping_a_kv_store_is_refused_a_role_flip_and_serves_on(pc, reference):
    """Workers with a KV store start without role switching (SGLang deletes its HiCache storage at a flip): a flip is
    refused before anything changes, over HTTP (a planner's call) and from the CLI, naming why."""
    pc.ensure()
    wid, bootstrap = pc.worker_id("prefill-0"), pc.local.spec.bootstrap_url
    response = httpx.post(f"{bootstrap}/v1/workers/{wid}/switch", json={"to": "decode"}, timeout=10)
    error = response.json()["error"]
    assert response.status_code == 409 and error["refusal"] == "not_switch_enabled", response.text
    assert "not started switch-enabled" in error["message"] and "kv_store" in error["message"], error
    cli = subprocess.run([sys.executable, "-m", "bootstrap", "switch", wid, "--to", "decode", "--url", bootstrap],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and f"{wid}: refused (not_switch_enabled)" in cli.stderr, (cli.stdout, cli.stderr)
    assert error["message"] in cli.stderr
    # Nothing changed: still a prefill, not draining, and it serves through the router, token-exact.
    row = next(w for w in httpx.get(f"{bootstrap}/v1/workers", timeout=10).json()["workers"]
               if w["registration"]["worker_id"] == wid)
    assert row["registration"]["role"] == "prefill" and not row["draining"] and row["switch"] is None, row
    prompt = prompt_ids(reference.tokenizer, "not-switch-enabled", 40)
    answer = pc.generate(prompt, MAX_NEW)
    assert answer.prefill == "prefill-0"
    assert_matches(answer.output_ids, greedy_ids(reference, prompt, MAX_NEW), reference.eos)
