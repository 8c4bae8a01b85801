"""Plain-`transformers` greedy reference, to compare SGLang output against token for token."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def greedy_reference(model_dir: str, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy-decode each prompt (already tokenized, incl. BOS) on CPU in float32.

    Returns only the new token ids per prompt. Like `generate`, a sequence stops after the
    first eos, and that eos id is included as its last element.
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cpu").eval()
    eos = model.config.eos_token_id
    results: list[list[int]] = []
    for ids in prompts_ids:
        # One prompt per call: no padding, so no pad/attention-mask effects on the logits.
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=eos,
            )
        results.append(out[0, len(ids):].tolist())
    return results
