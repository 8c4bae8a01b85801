"""Greedy reference with plain `transformers`, with the top-2 logit margin of every step.

A random-weight model has near-exact logit ties now and then; two correct engines may break such a tie differently.
So a divergence is accepted only at a step where the reference's own top-2 margin is ~0, and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TIE_MARGIN = 1e-3


@dataclass
class Reference:
    prompt_ids: list[int]
    ids: list[int]
    margins: list[float]


class ReferenceModel:
    def __init__(self, model_dir: str):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = self.model.config.eos_token_id

    def greedy(self, text: str, max_new_tokens: int) -> Reference:
        return self.greedy_ids(self.tokenizer(text)["input_ids"], max_new_tokens)

    def greedy_ids(self, prompt: list[int], max_new_tokens: int) -> Reference:
        """For a prompt given as token ids (a chat template's, a next turn's: ids that do not round-trip as text)."""
        ids, margins = list(prompt), []
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                top2 = torch.topk(logits, 2)
                margins.append(float(top2.values[0] - top2.values[1]))
                ids.append(int(top2.indices[0]))
                if ids[-1] == self.eos:
                    break
        return Reference(list(prompt), ids[len(prompt):], margins)


    def prompt_logprobs(self, text: str) -> list[float]:
        """log p(token i | tokens < i) for every prompt token after the first."""
        ids = self.tokenizer(text)["input_ids"]
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        return [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def assert_matches(got: list[int], ref: Reference, eos: int) -> None:
    want = [t for t in ref.ids if t != eos]
    got = [t for t in got if t != eos]
    for step, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            assert ref.margins[step] < TIE_MARGIN, (
                f"token {step}: got {g}, reference {w} (reference top-2 margin {ref.margins[step]:.4g}, not a tie)\n"
                f"got  {got}\nwant {want}")
            return
    assert len(got) == len(want), f"got {len(got)} tokens, reference {len(want)}\ngot  {got}\nwant {want}"
