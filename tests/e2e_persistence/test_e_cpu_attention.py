"""pdcluster's CPU extend attention (pdcluster/plugins/cpu_attention, on by default in the CPU profile) on the cases
where it computes only part of a sequence: a chunked prefill (every chunk after the first has a prefix), hits from
memory and from disk, a batch mixing hits and misses, on a model whose query heads share KV heads (GQA). Tokens must
equal transformers' without any cache.

The model is the demo model's shape with 2 KV heads for its 4 query heads; the prefill runs with a chunked-prefill
size of 128 tokens (SGLang's default, 4096 on this machine, would never chunk a prompt the demo model takes): one
restart of this cluster's prefill and decode for both.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e.reference import ReferenceModel, assert_matches
from tests.e2e_persistence.conftest import PAGE, REPO, greedy_ids, prompt_ids

MAX_NEW = 16
CHUNK = 128  # a multiple of the page size, as SGLang requires
SHAPE = {"prefill-0": ("--chunked-prefill-size", str(CHUNK)), "decode-0": ()}


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("gqa-model") / "tiny-llama-gqa"
    subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(out), "--kv-heads", "2"], cwd=REPO,
                   check=True)
    return out


@pytest.fixture(scope="module")
def reference(gqa_model):
    return ReferenceModel(str(gqa_model))


@pytest.fixture(scope="module")
def gqa(pc, gqa_model) -> int:
    """This module's cluster shape; the offset in the prefill's log where its run begins."""
    offset = pc.log("prefill-0").stat().st_size if pc.log("prefill-0").exists() else 0
    pc.ensure(SHAPE, model=gqa_model)
    return offset


def check(answer, reference, prompt):
    assert_matches(answer.output_ids, greedy_ids(reference, prompt, MAX_NEW), reference.eos)


def test_chunked_prefill_then_hits_from_memory_and_from_disk(pc, reference, gqa):
    tok = reference.tokenizer
    prompt = prompt_ids(tok, "cpu-attention", 600)  # 5 chunks of 128: 4 of them attend to a prefix
    cold = pc.generate(prompt, MAX_NEW)
    assert cold.cached == 0, cold
    check(cold, reference, prompt)

    memory = pc.generate(prompt, MAX_NEW)
    assert memory.cached >= 600 // PAGE * PAGE, memory  # whole pages; the rest is computed against them
    check(memory, reference, prompt)

    shared = prompt[:320] + prompt_ids(tok, "cpu-attention-tail", 281)[1:]  # 320 cached, 280 new: 3 chunks
    partial = pc.generate(shared, MAX_NEW)
    assert 256 <= partial.cached <= 320, partial
    check(partial, reference, shared)

    pc.settle()
    response = httpx.post(f"{pc.url('prefill-0')}/flush_cache", params={"timeout": 30}, timeout=60)
    assert response.status_code == 200, response.text
    disk = pc.generate(prompt, MAX_NEW)
    assert disk.storage >= 512, disk
    check(disk, reference, prompt)


def test_a_batch_mixing_hits_and_misses(pc, reference, gqa):
    tok = reference.tokenizer
    seen = prompt_ids(tok, "cpu-attention-seen", 400)
    pc.generate(seen, MAX_NEW)
    prompts = [seen, prompt_ids(tok, "cpu-attention-miss", 300),
               seen[:200] + prompt_ids(tok, "cpu-attention-x", 200)[1:], prompt_ids(tok, "cpu-attention-short", 30)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    response = pc.client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answers = response.json()
    cached = [a["meta_info"].get("cached_tokens", 0) for a in answers]
    assert cached[0] >= 384 and cached[1] == 0 and cached[2] >= 192 and cached[3] == 0, cached
    for answer, prompt in zip(answers, prompts, strict=True):
        assert_matches(answer["output_ids"], greedy_ids(reference, prompt, MAX_NEW), reference.eos)


def test_every_extend_went_through_pdclusters_attention(pc, gqa):
    log = pc.log("prefill-0").read_bytes()[gqa:].decode(errors="replace")
    assert "pdcluster cpu_attention active" in log, "the restarted prefill did not load pdcluster/plugins/cpu_attention"
    assert "SGLang's own extend attention for" not in log, "an extend of these tests went to SGLang's own attention"
