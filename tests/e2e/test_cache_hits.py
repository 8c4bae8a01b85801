"""A prompt served again from a prefill's radix cache, alone or in a batch with prompts it has not seen, gets the tokens
transformers computes without any cache. On CPU the prefill's extend attention is pdcluster's
(pdcluster/plugins/cpu_attention, on by default): it computes only the tokens not cached, so these are its end-to-end
exactness checks (GQA and chunked prefills: tests/e2e_persistence/test_e_cpu_attention.py)."""

from __future__ import annotations

import random

from tests.e2e.prompts import SENTENCES
from tests.e2e.reference import assert_matches
from tests.helpers import worker_url

MAX_NEW = 16
ACTIVE = "pdcluster cpu_attention active"


def words(tag: str, n: int) -> str:
    """Text of n words, another tag giving another text from its first word on (so nothing of it is cached yet)."""
    rng, pool = random.Random(tag), SENTENCES.split()
    return " ".join(rng.choice(pool) for _ in range(n))


def send(router, texts: str | list[str]) -> tuple[list[dict], str]:
    body = {"text": texts, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    response = router.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answers = response.json()
    return (answers if isinstance(answers, list) else [answers]), response.headers["x-pdcluster-prefill"]


def warm_every_prefill(router, texts: list[str]) -> None:
    """Round robin over the two prefills: each of them sees each text."""
    seen: set[str] = set()
    for _ in range(4):
        _, prefill = send(router, texts)
        seen.add(prefill)
        if len(seen) == 2:
            return
    raise AssertionError(f"four requests reached only {seen}")


def test_the_prefills_run_pdclusters_cpu_attention(cluster):
    for name in ("prefill-0", "prefill-1"):
        log = cluster.processes[name].log_path.read_text(errors="replace")
        assert ACTIVE in log, f"{name} ({worker_url(cluster, name)}) did not load pdcluster/plugins/cpu_attention"


def test_a_repeated_prompt_is_a_cache_hit_with_the_same_tokens(router, reference):
    text = words("repeat", 450)
    ref = reference.greedy(text, MAX_NEW)
    answers = [send(router, text)[0][0] for _ in range(3)]  # round robin: a prefill sees it a second time
    cached = [a["meta_info"]["cached_tokens"] for a in answers]
    assert max(cached) >= len(ref.prompt_ids) - 1, cached  # all but the last token, which makes the logits
    for answer in answers:
        assert_matches(answer["output_ids"], ref, reference.eos)


def test_a_batch_mixing_hits_partial_hits_and_misses(router, reference):
    seen, shared = words("batch-seen", 400), words("batch-shared", 300)
    warm_every_prefill(router, [seen, shared])
    texts = [seen, words("batch-new", 350), shared + " " + words("batch-tail", 150), words("batch-new-2", 20)]
    answers, _ = send(router, texts)
    refs = [reference.greedy(t, MAX_NEW) for t in texts]
    cached = [a["meta_info"]["cached_tokens"] for a in answers]
    assert cached[0] >= len(refs[0].prompt_ids) - 1, cached
    assert cached[2] >= len(reference.tokenizer(shared)["input_ids"]) - 2, cached  # the shared part, give or take
    assert cached[1] < 8 and cached[3] < 8, cached  # at most a few tokens a new text shares with others
    for answer, ref in zip(answers, refs, strict=True):
        assert_matches(answer["output_ids"], ref, reference.eos)
