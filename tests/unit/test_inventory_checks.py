"""The inventory applied (router/checks/validation.py): every refused field on every route, unknown fields, nulls, and
the limits that bodies found to crash SGLang 0.5.23 now hit at the router. Each crash case names what it did to a real
worker before (tests/e2e/test_trust_boundary.py sends the same bodies to a real cluster)."""

from __future__ import annotations

import pytest

from pdcluster.common.http import ApiError
from router.checks.inventory import CHAT, COMPLETION, GENERATE, MESSAGE, SAMPLING, Decision
from router.checks.validation import check_chat, check_completion, check_generate
from router.pd.pairing import ModelLimits, check_for_pair

LIMITS = ModelLimits(vocab_size=1000, context_length=64)
CHAT_BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(table: dict) -> list[str]:
    return [name for name, rule in table.items() if rule.decision is Decision.REFUSED]


def refusal(check, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check_for_pair(check(body), LIMITS)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(("check", "base", "table", "where"), [
    (check_generate, {"text": "a"}, GENERATE, ""),
    (check_completion, {"prompt": "a"}, COMPLETION, ""),
    (check_chat, CHAT_BASE, CHAT, ""),
])
def test_every_refused_field_is_refused_with_its_reason(check, base, table, where):
    for name in refused(table):
        error = refusal(check, {**base, name: 1})
        assert error.param == name and error.message == f"{name} is not accepted: {table[name].reason}"


@pytest.mark.parametrize(("check", "base", "table"), [
    (check_generate, {"text": "a"}, GENERATE),
    (check_completion, {"prompt": "a"}, COMPLETION),
    (check_chat, CHAT_BASE, CHAT),
])
def test_a_refused_field_as_null_or_as_sglang_default_is_not_given_and_not_sent(check, base, table):
    for name in refused(table):
        body = {**base, name: None}
        check(body)
        assert name not in body
        default = table[name].default
        if default is None:
            continue
        body = {**base, name: default}
        check(body)
        assert name not in body
        other = (not default) if isinstance(default, bool) else default + 1 if isinstance(default, int) else "x"
        assert refusal(check, {**base, name: other}).param == name
        if isinstance(default, bool):  # 0 is not false: the type is SGLang's too
            assert refusal(check, {**base, name: int(default)}).param == name


def test_refused_fields_inside_sampling_params_and_messages():
    for name in refused(SAMPLING):
        error = refusal(check_generate, {"text": "a", "sampling_params": {name: 1}})
        assert error.param == f"sampling_params.{name}" and SAMPLING[name].reason in error.message
    for name in refused(MESSAGE):
        error = refusal(check_chat, {"messages": [{"role": "user", "content": "a"}, {"role": "user", name: 1}]})
        assert error.param == f"messages[1].{name}" and MESSAGE[name].reason in error.message


@pytest.mark.parametrize(("check", "body", "param"), [
    (check_generate, {"text": "a", "temprature": 0.5}, "temprature"),
    (check_generate, {"text": "a", "sampling_params": {"max_tokens": 5}}, "sampling_params.max_tokens"),
    (check_generate, {"text": ["a", "b"], "sampling_params": [{}, {"x": 1}]}, "sampling_params[1].x"),
    (check_completion, {"prompt": "a", "metadata": {}}, "metadata"),
    (check_chat, {**CHAT_BASE, "web_search_options": {}}, "web_search_options"),
])
def test_a_field_no_table_knows_is_refused(check, body, param):
    error = refusal(check, body)
    assert error.param == param and "unknown field" in error.message and "docs/limits.md" in error.message


def test_null_is_not_given_and_is_not_sent():
    body = {"text": "a", "stream": None, "sampling_params": {"n": None, "temperature": None, "max_new_tokens": 3}}
    check_generate(body)
    assert body == {"text": "a", "sampling_params": {"max_new_tokens": 3}}  # `n: null` made the decode answer 500


@pytest.mark.parametrize(("check", "body", "param"), [
    # Each took a worker down (the scheduler died, every request it held failed) or made it answer 500.
    (check_generate, {"text": "a", "sampling_params": {"top_k": 2**63 - 1}}, "sampling_params.top_k"),
    (check_generate, {"text": "a", "return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
    (check_generate, {"text": "a", "return_logprob": True, "top_logprobs_num": 10**9}, "top_logprobs_num"),
    (check_generate, {"text": "a", "return_logprob": True, "top_logprobs_num": 2000}, "top_logprobs_num"),
    (check_chat, {**CHAT_BASE, "logprobs": True, "top_logprobs": 10**9}, "top_logprobs"),
    (check_completion, {"prompt": "a", "top_k": 2, "repetition_penalty": 1e-300}, "repetition_penalty"),
    (check_generate, {"text": "a", "sampling_params": {"frequency_penalty": 2, "presence_penalty": -2,
                                                       "repetition_penalty": 0.0001}},
     "sampling_params.repetition_penalty"),
    (check_generate, {"input_ids": [5, 6, 7], "sampling_params": [{"max_new_tokens": 4}]}, "sampling_params"),
    (check_chat, {**CHAT_BASE, "chat_template_kwargs": {"add_generation_prompt": 5}},
     "chat_template_kwargs.add_generation_prompt"),
    (check_generate, {"text": "a", "return_logprob": [True]}, "return_logprob"),
])
def test_bodies_that_crashed_a_worker_are_refused_at_the_router(check, body, param):
    assert refusal(check, body).param == param


@pytest.mark.parametrize(("check", "body", "message"), [
    # min_new_tokens > 0 with an id out of the vocabulary: "index 5000 is out of bounds" in the penalizer, a crash.
    (check_generate, {"text": "x", "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 4,
                                                       "stop_token_ids": [5000]}},
     "sampling_params.stop_token_ids[0] is 5000: token ids must be in [0, 1000)"),
    (check_generate, {"text": ["x", "y"], "sampling_params": [{}, {"stop_token_ids": [1, 1000]}]},
     "sampling_params[1].stop_token_ids[1] is 1000"),
    (check_generate, {"text": "x", "sampling_params": {"logit_bias": {"5": 1.0, "1000": -1}}},
     "sampling_params.logit_bias[1] is 1000"),
    (check_generate, {"text": "x", "return_logprob": True, "token_ids_logprob": [999, 1000]},
     "token_ids_logprob[1] is 1000"),
    (check_chat, {**CHAT_BASE, "stop_token_ids": [1000]}, "stop_token_ids[0] is 1000"),
    (check_completion, {"prompt": "x", "logit_bias": {"4096": 3}}, "logit_bias[0] is 4096"),
    (check_generate, {"text": "x", "sampling_params": {"max_new_tokens": 65}},
     "sampling_params.max_new_tokens is 65; the model's context length is 64"),
    (check_chat, {**CHAT_BASE, "max_completion_tokens": 65}, "max_completion_tokens is 65"),
    (check_generate, {"text": "x", "return_logprob": True, "logprob_start_len": 64}, "logprob_start_len is 64"),
])
def test_ids_counts_and_positions_are_checked_against_the_pair(check, body, message):
    assert refusal(check, body).message.startswith(message)


def test_a_full_valid_body_of_each_route_passes():
    sampling = {"max_new_tokens": 64, "min_new_tokens": 1, "stop": ["\n", "end"], "stop_token_ids": [0, 999],
                "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "frequency_penalty": 0.5,
                "presence_penalty": -0.5, "repetition_penalty": 1.1, "n": 1, "regex": "[a-z]+", "ignore_eos": False,
                "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
                "stream_interval": 2, "logit_bias": {"5": -100, "7": 2.5}}
    check_for_pair(check_generate({"text": ["a", "b"], "sampling_params": [sampling, {}], "stream": True,
                                   "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
                                   "token_ids_logprob": [1, 2], "return_text_in_logprobs": True, "no_logs": True,
                                   "rid": ["x", "y"]}), LIMITS)
    check_for_pair(check_completion({"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 8, "logprobs": 5,
                                     "echo": False, "best_of": 1, "stop": "x", "user": "u",
                                     "stream": True, "stream_options": {"include_usage": True}}), LIMITS)
    check_for_pair(check_chat({**CHAT_BASE, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}],
                                                    "name": "bob"}, {"role": "assistant", "content": "Hel"}],
        "continue_final_message": True, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
        LIMITS)
