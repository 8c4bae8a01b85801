"""The router refuses bad input itself, with a 400 that names the field, before any worker sees it."""

import pytest

from pdcluster.http import ApiError
from router.validation import check_chat, check_completion, check_generate


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"sampling_params": {"max_new_tokens": 4}}, "body", "one of text or input_ids is required"),
        ({"text": "a", "input_ids": [1, 2]}, "body", "only one of text and input_ids"),
        ({"text": "a", "input_embeds": [[0.1]]}, "body", "only one of text and input_embeds"),
        ({"text": 5}, "text", "text"),
        ({"input_ids": ["a"]}, "input_ids.0", "input_ids.0"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", "greater than"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens", "integer"),
        ({"text": "a", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature", "greater than"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "greater than 0"),
        ({"text": "a", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "less than or equal to 1"),
        ({"text": "a", "stream": "yes"}, "stream", "boolean"),
        ({"text": [], "sampling_params": {}}, "body", "text is empty"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "1 items for 2 inputs"),
        ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params.n", "n > 1"),
    ],
)
def test_bad_generate_bodies_get_400_naming_the_field(body, param, fragment):
    with pytest.raises(ApiError) as caught:
        check_generate(body)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert fragment in caught.value.message


def test_valid_generate_bodies_pass_and_report_batches():
    assert check_generate({"text": "hi", "sampling_params": {"temperature": 0, "top_p": 1}}).batch_size is None
    assert check_generate({"text": ["a", "b", "c"]}).batch_size == 3
    assert check_generate({"input_ids": [[1, 2], [3]]}).batch_size == 2
    assert check_generate({"input_ids": [1, 2, 3], "stream": True}).stream is True
    # Unknown fields are SGLang's business and pass untouched.
    assert check_generate({"text": "a", "return_logprob": True, "sampling_params": {"regex": "a+"}})


@pytest.mark.parametrize(
    ("check", "body", "param"),
    [
        (check_completion, {"model": "m"}, "prompt"),
        (check_completion, {"model": "m", "prompt": "a", "max_tokens": -1}, "max_tokens"),
        (check_completion, {"model": "m", "prompt": "a", "top_p": 2}, "top_p"),
        (check_completion, {"model": "m", "prompt": "a", "n": 3}, "n"),
        (check_chat, {"model": "m", "messages": []}, "messages"),
        (check_chat, {"model": "m", "messages": [{"content": "hi"}]}, "messages.0.role"),
        (check_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ],
)
def test_bad_openai_bodies_get_400_naming_the_field(check, body, param):
    with pytest.raises(ApiError) as caught:
        check(body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_openai_batches():
    assert check_completion({"model": "m", "prompt": ["a", "b"]}).batch_size == 2
    assert check_completion({"model": "m", "prompt": [1, 2, 3]}).batch_size is None
