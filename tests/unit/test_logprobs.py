"""return_logprob under PD: the prefill's input logprobs go in front of the decode's, as SGLang's router does."""

import json

from router import logprobs
from router.request import wants_logprobs


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
