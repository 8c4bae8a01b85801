"""The router refuses bad input itself, with a 400 that names the field, before any worker sees it."""

import pytest

from pdcluster.common.http import ApiError
from router.checks.checked import HINT_CHARS
from router.checks.validation import check_chat, check_completion, check_generate, may_vanish
from router.pd.pairing import ModelLimits, check_for_pair
from router.service import client_request_id


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"sampling_params": {"max_new_tokens": 4}}, "body", "one of text or input_ids is required"),
        ({"text": "a", "input_ids": [1, 2]}, "body", "only one of text and input_ids"),
        ({"text": "a", "input_embeds": [[0.1]]}, "input_embeds", "input_embeds is not accepted: embeddings bypass"),
        ({"text": 5}, "text", "text"),
        ({"input_ids": "1 2"}, "input_ids", "input_ids"),
        ({"input_ids": [[1], 2]}, "input_ids[1]", "input_ids[1] must be a non-empty list"),
        ({"input_ids": [[1], []]}, "input_ids[1]", "input_ids[1] must be a non-empty list"),
        ({"text": ["a", ""]}, "text[1]", "at least 1 character"),
        ({"text": "a", "rid": 5}, "rid", "rid"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid", "1 items for 2 inputs"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", "greater than"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens", "integer"),
        ({"text": "a", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature", "greater than"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "greater than 0"),
        ({"text": "a", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "less than or equal to 1"),
        ({"text": "a", "stream": "yes"}, "stream", "boolean"),
        ({"text": [], "sampling_params": {}}, "text", "text: List should have at least 1 item"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "1 items for 2 inputs"),
        ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params.n", "1 only: the OpenAI routes serve more"),
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
        (check_completion, {"model": "m", "prompt": "a", "n": 65}, "n"),  # router/openai/fanout.py serves 2 to max_n
        (check_chat, {"model": "m", "messages": []}, "messages"),
        (check_chat, {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
        (check_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        (check_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "rid": 7}, "rid"),
        (check_completion, {"model": "m", "prompt": [[1], "a"]}, "prompt[1]"),
        # A fuzzer's find: echo 0 equals false, but it is no boolean (the schema says so).
        (check_completion, {"model": "m", "prompt": "a", "echo": 0}, "echo"),
        (check_completion, {"model": "m", "prompt": "a", "echo": 0.0}, "echo"),
        (check_completion, {"model": "m", "prompt": "a", "echo": 1}, "echo"),
        # SGLang 0.5.23's completions read a prompt of ids all 0 as empty: its 400 named the worker.
        (check_completion, {"model": "m", "prompt": [0, 0]}, "prompt"),
        # OpenAI's 400: stream_options only with stream true
        (check_completion, {"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        (check_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": False,
                      "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_openai_bodies_get_400_naming_the_field(check, body, param):
    with pytest.raises(ApiError) as caught:
        check(body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_openai_batches():
    assert check_completion({"model": "m", "prompt": ["a", "b"]}).batch_size == 2
    assert check_completion({"model": "m", "prompt": [1, 2, 3]}).batch_size is None


LIMITS = ModelLimits(vocab_size=1000, context_length=64)


@pytest.mark.parametrize(
    ("check", "body", "fragment"),
    [
        (check_generate, {"input_ids": [999999999]}, "input_ids[0] is 999999999: token ids must be in [0, 1000)"),
        (check_generate, {"input_ids": [5, -1]}, "input_ids[1] is -1"),
        (check_generate, {"input_ids": [5, 1000]}, "input_ids[1] is 1000"),
        (check_generate, {"input_ids": [[1, 2], [3, 4, 1000]], "stream": True}, "input_ids[1][2] is 1000"),
        (check_generate, {"input_ids": [1, "a"]}, 'input_ids[1] is "a", not a token id'),
        (check_generate, {"input_ids": [1, 2.0]}, "input_ids[1] is 2.0, not a token id"),
        (check_generate, {"input_ids": [1, True]}, "input_ids[1] is true, not a token id"),
        (check_generate, {"input_ids": [[1, [2]]]}, "input_ids[0][1] is [2], not a token id"),
        (check_generate, {"input_ids": list(range(65))}, "input_ids has 65 tokens; the model's context length is 64"),
        (check_completion, {"prompt": [1, 4000]}, "prompt[1] is 4000"),
        (check_completion, {"prompt": [[1], [-7]]}, "prompt[1][0] is -7"),
    ],
)
def test_token_ids_are_checked_against_the_pairs_model(check, body, fragment):
    checked = check(body)
    with pytest.raises(ApiError) as caught:
        check_for_pair(checked, LIMITS)
    assert caught.value.status == 400 and caught.value.message.startswith(fragment)


def test_good_token_ids_pass_and_text_needs_no_limits():
    check_for_pair(check_generate({"input_ids": [0, 999]}), LIMITS)
    check_for_pair(check_completion({"prompt": [[0], [999] * 64]}), LIMITS)
    check_for_pair(check_generate({"text": "x" * 10_000}), ModelLimits(None, None))


def test_token_ids_with_an_unknown_vocabulary_are_refused_not_forwarded():
    with pytest.raises(ApiError) as caught:
        check_for_pair(check_generate({"input_ids": [1]}), ModelLimits(None, 64))
    assert caught.value.status == 503 and "vocab_size" in caught.value.message


def test_the_prefix_hint_is_bounded():
    assert len(check_generate({"text": "x" * 1_000_000}).hint) == HINT_CHARS
    assert len(check_generate({"input_ids": [1] * 1_000_000}).hint) <= HINT_CHARS
    chat = check_chat({"messages": [{"role": "user", "content": "y" * 1_000_000}]})
    assert len(chat.hint) == HINT_CHARS


@pytest.mark.parametrize("value", ["", "x" * 129, "a b", "é", "a\nb"])
def test_a_client_request_id_is_limited(value):
    with pytest.raises(ApiError) as caught:
        client_request_id(value)
    assert caught.value.status == 400 and caught.value.param == "X-Request-ID"


def test_a_client_request_id_like_a_uuid_is_kept():
    assert client_request_id("0b8e7a4c-2f0e-4a8e-9c1d-5d6f7e8a9b0c") == "0b8e7a4c-2f0e-4a8e-9c1d-5d6f7e8a9b0c"


@pytest.mark.parametrize(
    ("prompt", "param", "fragment"),
    [
        (["a", ""], "prompt[1]", "prompt[1] is empty"),  # crashed SGLang's prefill scheduler (a 0-token extend)
        ([""], "prompt[0]", "prompt[0] is empty"),
        (["a", [1, 2]], "prompt[1]", "all texts or all token-id lists"),
        ([[1, 2], "a"], "prompt[1]", "a batch is all lists"),
        ([[1], []], "prompt[1]", "non-empty list of token ids"),
        (["a"] * 65, "prompt", "a batch is at most 64"),
        ([[1]] * 65, "prompt", "a batch is at most 64"),
    ],
)
def test_every_item_of_a_completion_prompt_is_decided(prompt, param, fragment):
    with pytest.raises(ApiError) as caught:
        check_completion({"model": "m", "prompt": prompt})
    assert (caught.value.status, caught.value.param) == (400, param)
    assert fragment in caught.value.message


def test_completions_refuse_max_tokens_0_as_sglang_does():
    with pytest.raises(ApiError) as caught:
        check_completion({"model": "m", "prompt": "a", "max_tokens": 0})
    assert caught.value.param == "max_tokens"
    assert check_completion({"model": "m", "prompt": "a", "max_tokens": 1})


@pytest.mark.parametrize(("text", "vanishes"), [
    (" ", True), ("\u200b\u200b", True), ("\u0000", True), ("\n\t \u2028", True), ("\u0301", True),
    ("a", False), ("  a  ", False), ("\u200ba", False), ("é", False), ("🦀", False), (" " * 10**6 + ".", False),
])
def test_only_texts_a_normalizer_may_erase_are_counted_by_the_pair(text, vanishes):
    assert may_vanish(text) is vanishes
    checked = check_completion({"model": "m", "prompt": ["x", text]})
    assert checked.may_vanish == ((("prompt[1]", text),) if vanishes else ())
    single = check_generate({"text": text})
    assert single.may_vanish == ((("text", text),) if vanishes else ())


def test_a_long_text_of_format_characters_costs_c_time():
    """16 MiB of zero-width spaces (the router's body limit) are decided by a regex, not a Python loop."""
    import time
    may_vanish("\u200b")  # the pattern is built once, on first need
    started = time.process_time()
    assert may_vanish("\u200b" * (16 * 2**20 // 3))
    assert time.process_time() - started < 1.0


def test_openai_fields_sglang_does_not_know_are_accepted_and_never_sent():
    """What today's OpenAI clients send (the official client's `store`, `metadata`, `service_tier`; LangChain's and the
    Agents SDK's `prompt_cache_key`, `safety_identifier`, `verbosity`): type-checked, then left out of the body the
    workers get."""
    sent = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "prompt_cache_key": "k",
            "safety_identifier": "u1", "verbosity": "low"}
    body = {"messages": [{"role": "user", "content": "hi"}], **sent}
    check_chat(body)
    assert body == {"messages": [{"role": "user", "content": "hi"}]}
    for field, bad in (("store", "yes"), ("metadata", {"k": 1}), ("service_tier", "fastest"), ("verbosity", 3),
                       ("metadata", {f"k{i}": "v" for i in range(17)})):
        with pytest.raises(ApiError) as refused:
            check_chat({"messages": [{"role": "user", "content": "hi"}], field: bad})
        assert refused.value.status == 400 and refused.value.param.startswith(field), (field, refused.value.message)


@pytest.mark.parametrize(("check", "body", "param"), [
    (check_generate, {"text": "a", "sampling_params": {"regex": "½\U0007b42d"}}, "sampling_params.regex"),
    (check_generate, {"text": "a", "sampling_params": {"ebnf": 'root ::= "\ue000"'}}, "sampling_params.ebnf"),
    (check_completion, {"prompt": "a", "regex": "x\U0010fffd"}, "regex"),
    (check_chat, {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["\U000f0000"]}}}},
     "response_format.json_schema.schema"),
])
def test_a_grammar_with_code_points_no_token_is_made_of_is_refused(check, body, param):
    """Found by the schema fuzzer on SmolLM2: a regex with an unassigned code point (U+7B42D) left SGLang's grammar
    engine allowing no token; the sampled request then killed the decode's scheduler (torch.multinomial on NaN)."""
    with pytest.raises(ApiError) as refused:
        check(body)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    assert "code point" in refused.value.message


def test_a_grammar_in_any_script_is_accepted():
    for regex in ("½[0-9]+", "(да|нет)", "[\u4e00-\u9fff]{1,4}", "😀+"):
        check_generate({"text": "a", "sampling_params": {"regex": regex}})
