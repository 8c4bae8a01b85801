#!/usr/bin/env python
"""Build a tiny random-weight Llama model + byte-level BPE tokenizer, fully offline.

The result is a real HF checkpoint (config.json, model.safetensors, tokenizer.json, ...)
that SGLang can serve on CPU, so the PD-disaggregated cluster can be tested end to end and
compared token-for-token against a plain `transformers` reference (scripts/reference_generate.py).

Usage: python scripts/build_demo_model.py [--out models/tiny-llama] [--force]
       [--seed N] [--layers N] [--hidden N] [--intermediate N] [--heads N] [--kv-heads N] [--max-positions N]
       [--initializer-range X]
With no size/seed option the result is the demo model, byte for byte. Other seeds give other weights with the same
tokenizer (tests: a model that must never read the demo model's stored KV); other sizes give a model whose prefill
costs seconds on a CPU (bench/persistence/).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import shutil
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parent.parent
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0..3, in this order
VOCAB_SIZE = 1000
SEED = 1234
# 10x Llama's default 0.02: at hidden_size=64 that gives near-flat logits (median top-2 margin
# ~0.05) and greedy output that can loop on one token. At 0.2 greedy text is varied and the median
# margin is ~0.4 while fp32 rounding moves logits by ~1e-5; larger values widen margins but also
# fp32 error (0.5: ~2e-4), so 0.2 keeps token-exact engine comparisons safest.
INITIALIZER_RANGE = 0.2
# Only role-tagged text; `bos_token` is written explicitly because apply_chat_template(tokenize=True)
# encodes with add_special_tokens=False. String literals (not raw newlines) survive trim_blocks.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Stdlib modules whose docstrings form the tokenizer corpus: local, offline, and fixed for a
# given Python version. Sorted so iteration order never depends on how the list is edited.
CORPUS_MODULES = sorted([
    "abc", "argparse", "asyncio", "base64", "bisect", "collections", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "email", "enum", "fractions", "functools", "gzip",
    "hashlib", "heapq", "hmac", "http.client", "itertools", "json", "logging", "os", "pathlib",
    "random", "re", "select", "shutil", "socket", "sqlite3", "statistics", "string", "struct",
    "subprocess", "sys", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "zipfile",
])


def corpus() -> list[str]:
    """Docstrings of the corpus modules and their public functions/classes, de-duplicated."""
    docs: dict[str, None] = {}  # dict keeps first-seen order, unlike a set
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            if (obj is mod or inspect.isclass(obj) or inspect.isroutine(obj)) and (doc := inspect.getdoc(obj)):
                docs[doc] = None
    return list(docs)


def build_tokenizer(max_positions: int = 2048) -> PreTrainedTokenizerFast:
    # Byte-level BPE with the full 256-byte alphabet: any UTF-8 text encodes without <unk>, and
    # no normalizer, so decode(encode(text)) == text exactly.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # Prepend <s> inside tokenizer.json itself, so every loader (transformers, SGLang) agrees.
    # Same strings as transformers' update_post_processor() would generate for add_bos_token.
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
        special_tokens=[("<s>", tok.token_to_id("<s>"))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", add_bos_token=True, add_eos_token=False, model_max_length=max_positions,
        clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
    )


# The demo model's shape; every one can be changed on the command line (the defaults build the demo model).
SHAPE = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 4, "max_positions": 2048}


def build_model(tok: PreTrainedTokenizerFast, seed: int = SEED, initializer_range: float = INITIALIZER_RANGE,
                **shape: int) -> LlamaForCausalLM:
    shape = {**SHAPE, **shape}
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["max_positions"],
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, dtype="float32",
        initializer_range=initializer_range, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)  # the only source of randomness in the weights
    return LlamaForCausalLM(config).to(torch.float32).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/tiny-llama", help="output dir (relative to repo root)")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--seed", type=int, default=SEED, help="weights' random seed (other seed: other weights)")
    for name, value in SHAPE.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help=f"default {value}")
    ap.add_argument("--initializer-range", type=float, default=INITIALIZER_RANGE)
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()  # keep output to the one summary line
    out = (REPO_ROOT / args.out).resolve()  # an absolute --out wins over REPO_ROOT
    options = {"seed": args.seed, "initializer_range": args.initializer_range,
               **{name: getattr(args, name) for name in SHAPE}}
    digest = hashlib.sha256(Path(__file__).read_bytes())
    if options != {"seed": SEED, "initializer_range": INITIALIZER_RANGE, **SHAPE}:
        digest.update(json.dumps(options, sort_keys=True).encode())  # another model: rebuilt when an option changes
    fingerprint = digest.hexdigest()

    info_path = out / "build-info.json"
    if (not args.force and info_path.is_file()
            and json.loads(info_path.read_text()).get("fingerprint") == fingerprint):
        print(f"{out}: up to date (fingerprint {fingerprint[:12]}), skipping; --force rebuilds")
        return
    if out.exists() and any(out.iterdir()) and not info_path.is_file():
        sys.exit(f"refusing to overwrite {out}: not empty and not built by this script")

    # Build into a scratch dir and swap it in, so a crash never leaves a half-written model
    # that a later run would mistake for a finished one.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = build_tokenizer(args.max_positions)
    model = build_model(tok, **options)
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp)  # safetensors, float32
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "fingerprint": fingerprint, **options,
        "vocab_size": len(tok), "num_parameters": n_params,
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
    }
    (tmp / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"built {out}: vocab_size={len(tok)} params={n_params}")


if __name__ == "__main__":
    main()
