"""Long texts encoded piece by piece give the ids of the whole text, for the models served here; a piece seen lately
is not encoded again; a tokenizer that would not agree is found out when it loads and encodes whole texts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors

from bench.routing.report import WORDS
from router.kv_routing import token_pieces
from router.kv_routing.token_pieces import PIECE_CHARS, SAMPLE, PieceTokenizer, pieces

MODELS = Path(__file__).resolve().parents[2] / "models"
FOLDERS = [MODELS / "smollm2-135m-instruct", MODELS / "tiny-llama"]


def tokenizer_of(folder: Path) -> Tokenizer:
    assert (folder / "tokenizer.json").is_file(), f"{folder.name} is built by `make setup`"
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def texts() -> list[str]:
    rng = random.Random(7)
    prose = " ".join(rng.choice(WORDS) for _ in range(3000))
    code = "def f(x):\n    return x  *  2  # twice\n\n" * 120
    mixed = "".join(rng.choice(["word ", "Wort, ", "слово. ", "词 ", "  ", "\n", "don't ", "x1 ", "ab-cd ", "é "])
                    for _ in range(4000))
    return [prose, code, mixed, SAMPLE * 3, "a " * 3000, "<|im_start|>system\nYou are kind. " * 200]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_pieces_joined_are_the_whole_texts_ids(folder: Path):
    tokenizer = tokenizer_of(folder)
    pieced = PieceTokenizer(tokenizer)
    assert pieced.by_pieces
    for text in texts():
        assert len(pieces(text)) > 1 or len(text) < 3 * PIECE_CHARS
        for special in (True, False):
            assert pieced.encode(text, special) == tokenizer.encode(text, add_special_tokens=special).ids


def test_cuts_depend_only_on_what_comes_before_them():
    text = " ".join(random.Random(1).choice(WORDS) for _ in range(2000))
    longer = text + " and then something else entirely"
    assert pieces(longer)[:-1] == pieces(text)[:-1]
    assert all(len(piece) >= PIECE_CHARS for piece in pieces(text)[:-1])
    assert "".join(pieces(text)) == text


class Counting:
    """A tokenizer that counts the characters it encodes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.chars = tokenizer, 0

    def encode(self, text: str, add_special_tokens: bool = True):
        self.chars += len(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_a_shared_prefix_is_encoded_once_and_the_kept_pieces_are_bounded(monkeypatch):
    counting = Counting(tokenizer_of(FOLDERS[0]))
    pieced = PieceTokenizer(counting)
    rng = random.Random(3)
    system = " ".join(rng.choice(WORDS) for _ in range(1500))
    first, second = system + " first question here", system + " a second question"
    pieced.encode(first, True)
    counting.chars = 0
    assert pieced.encode(second, True) == counting.tokenizer.encode(second).ids
    assert counting.chars < 2 * PIECE_CHARS  # its last piece only
    monkeypatch.setattr(token_pieces, "KEPT", 3)
    pieced.encode(" ".join(rng.choice(WORDS) for _ in range(1500)), True)
    assert len(pieced.kept) == 3


def test_a_tokenizer_that_adds_a_token_at_the_end_encodes_whole_texts():
    tokenizer = tokenizer_of(FOLDERS[0])
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[
        ("<|endoftext|>", eos)])
    pieced = PieceTokenizer(tokenizer)
    assert not pieced.by_pieces
    text = texts()[0]
    assert pieced.encode(text, True) == tokenizer.encode(text).ids and pieced.encode(text, True)[-1] == eos
    assert not pieced.kept
