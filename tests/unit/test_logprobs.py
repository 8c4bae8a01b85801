"""return_logprob under PD: the prefill's input logprobs go in front of the decode's, as SGLang's router does. And
/v1/completions' text_offset: each token's offset in its choice's text, whole and streamed."""

import json

import httpx
import pytest

from router.pd import logprobs
from router.pd.request import wants_logprobs
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_router_pd import cluster


def test_merge_puts_prefill_input_logprobs_first():
    decode = {"meta_info": {"input_token_logprobs": [], "output_token_logprobs": [[-0.5, 7, None]]}}
    prefill = {"meta_info": {"input_token_logprobs": [[None, 0, None], [-1.0, 5, None]]}}
    merged = logprobs.merge(decode, prefill)
    assert merged["meta_info"]["input_token_logprobs"] == [[None, 0, None], [-1.0, 5, None]]
    assert merged["meta_info"]["output_token_logprobs"] == [[-0.5, 7, None]]


def test_batches_merge_item_by_item():
    decode = [{"meta_info": {}}, {"meta_info": {}}]
    prefill = [{"meta_info": {"input_token_logprobs": [1]}}, {"meta_info": {"input_token_logprobs": [2]}}]
    assert [d["meta_info"]["input_token_logprobs"] for d in logprobs.merge(decode, prefill)] == [[1], [2]]


def test_prefill_stream_answer_is_its_last_event_and_first_decode_event_is_rewritten():
    stream = b'data: {"meta_info": {"input_token_logprobs": [9]}}\n\ndata: [DONE]\n\n'
    prefill = logprobs.prefill_answer(stream)
    event = logprobs.merge_first_event(b'data: {"text": "a", "meta_info": {}}\n\n', prefill)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["meta_info"]["input_token_logprobs"] == [9]


def test_wants_logprobs():
    assert wants_logprobs({"return_logprob": True})
    assert wants_logprobs({"return_logprob": [False, True]})
    assert not wants_logprobs({"text": "a"})


# --- /v1/completions' text_offset, which SGLang leaves at -1 ----------------------------------------------------------

def offsets(text: str, tokens: list[str]) -> list[int]:
    return logprobs.TextOffsets().add(text, tokens)


@pytest.mark.parametrize(("text", "tokens", "expected"), [
    ("Hello world", ["Hel", "lo", " world"], [0, 3, 5]),
    ("Hello world", ["Hello", "world"], [0, 5]),  # a SentencePiece token decoded alone lost its space
    ("a😀b", ["a", "\xf0\x9f", "\x98\x80", "b"], [0, 1, 1, 2]),  # one character's bytes over two tokens (latin-1)
    ("ok", ["ok", "</s>"], [0, 2]),  # a special token the text does not show
    ("yes", ["yes", "\n", "STOP"], [0, 3, 3]),  # a stop string trimmed from the text
    ("ab", ["\xff", "a", "b"], [0, 0, 1]),  # a byte that starts no character
    ("", [], []),
])
def test_each_token_starts_where_the_text_shows_it(text, tokens, expected):
    assert offsets(text, tokens) == expected
    assert all(text[o:].lstrip().startswith(t.lstrip()) for o, t in zip(expected, tokens, strict=True) if t in text)


def test_a_stream_counts_on_from_chunk_to_chunk_also_within_a_character():
    state = logprobs.TextOffsets()
    assert state.add("Hel", ["Hel"]) == [0]
    assert state.add("", ["\xf0\x9f"]) == [3]  # SGLang holds the text back until the character is whole
    assert state.add("😀 you", ["\x98\x80", " you"]) == [3, 4]


def test_a_whole_answer_gets_its_offsets_per_choice():
    answer = {"choices": [{"index": i, "text": "ab", "logprobs": {"tokens": ["a", "b"], "text_offset": [-1, -1]}}
                          for i in range(2)] + [{"index": 2, "text": "c", "logprobs": None}]}
    assert logprobs.fill_text_offsets(answer, {})
    assert [c["logprobs"] and c["logprobs"]["text_offset"] for c in answer["choices"]] == [[0, 1], [0, 1], None]
    assert not logprobs.fill_text_offsets({"choices": [{"text": "c", "logprobs": None}]}, {})


@pytest.mark.parametrize("n", [1, 2])
def test_the_router_fills_in_text_offsets_plain_and_streamed(n):
    decode = FakeWorker(Behaviour(tokens=["Hel", "lo", " world"]))
    with cluster(FakeWorker(), decode) as url:
        body = {"prompt": "say", "logprobs": 0, "n": n}
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "say"}],
                                                              "logprobs": True}, timeout=30).json()
    assert [c["logprobs"]["text_offset"] for c in plain["choices"]] == [[0, 3, 5]] * n
    got: dict[int, list[int]] = {}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                got.setdefault(choice["index"], []).extend(choice["logprobs"]["text_offset"])
    assert got == {i: [0, 3, 5] for i in range(n)}
    assert "text_offset" not in json.dumps(chat)  # chat's logprobs have none
