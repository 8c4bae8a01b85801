"""KV stored for one model is never read by another. SGLang's file names carry the tokens and the served model name
only: other weights behind the same path and name, or the same weights in another dtype, read the first model's bytes
(measured: wrong tokens, and all zeros in bfloat16) unless each model has its own namespace.

Both prompts are stored by the demo model first, in one go, so that the two cases cost two restarts, not three.
"""

from __future__ import annotations

import pytest

from tests.e2e.reference import assert_matches
from tests.e2e_persistence.conftest import PAGE, greedy_ids, prompt_ids

MAX_NEW = 16


@pytest.fixture(scope="module")
def stored(pc, reference) -> dict[str, tuple[list[int], list[int]]]:
    """Prompts whose pages the demo model (float32) has stored: name -> (prompt ids, the demo model's answer)."""
    pc.ensure()
    prompts = {name: prompt_ids(reference.tokenizer, name, 600) for name in ("bfloat16", "other-weights")}
    pages = pc.pages()
    answers = {name: pc.generate(ids, MAX_NEW) for name, ids in prompts.items()}
    pc.wait_pages(pages + len(prompts) * (600 // PAGE))
    for name, ids in prompts.items():
        assert_matches(answers[name].output_ids, greedy_ids(reference, ids, MAX_NEW), reference.eos)
    return {name: (ids, answers[name].output_ids) for name, ids in prompts.items()}


def test_same_model_in_bfloat16_never_hits_the_float32_pages(pc, reference, stored):
    prompt, _ = stored["bfloat16"]
    bf16 = ("--dtype", "bfloat16")
    pc.ensure({"prefill-0": bf16, "decode-0": bf16})
    answer = pc.generate(prompt, MAX_NEW)
    assert answer.storage == 0 and answer.cached == 0, answer
    # Exact tokens differ with the dtype; reading float32 bytes as bfloat16 gave all zeros.
    assert answer.completion_tokens == MAX_NEW or answer.output_ids[-1] == reference.eos, answer
    assert any(answer.output_ids), answer


def test_other_weights_behind_the_same_path_and_name_never_hit(pc, stored, other_model, other_reference):
    prompt, _ = stored["other-weights"]
    namespaces = len(pc.namespaces())
    pc.ensure(model=other_model)  # same config file, model path and served name; other bytes
    answer = pc.generate(prompt, MAX_NEW)
    assert answer.storage == 0 and answer.cached == 0, answer
    assert_matches(answer.output_ids, greedy_ids(other_reference, prompt, MAX_NEW), other_reference.eos)
    assert len(pc.namespaces()) == namespaces + 1  # its own namespace, next to the demo model's
