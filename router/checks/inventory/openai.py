"""The OpenAI API: every field of SGLang's `ChatCompletionRequest` and `CompletionRequest`
(sglang/srt/entrypoints/openai/protocol.py), and of a chat message, decided; the structured values' types are
router/checks/inventory/openai_types.py's. A field shared with the native API that means the same there takes the
native rule, so that one value is judged one way, for one reason, on every route."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictStr

from router.checks.inventory.native import (
    CACHE_KEY,
    DP,
    GENERATE,
    MULTIMODAL,
    REASONING,
    ROUTER_PD,
    SAMPLING,
    Prompts,
)
from router.checks.inventory.openai_types import (
    CalledFunction,
    CallId,
    Content,
    FunctionName,
    Metadata,
    ResponseFormat,
    StreamOptions,
    ThinkingSwitches,
    Tool,
    ToolCall,
    ToolChoice,
    ToolFunction,
)
from router.checks.inventory.rules import (
    MAX_MESSAGES,
    MAX_TOOLS,
    Choices,
    ClientId,
    Count,
    Flag,
    Name,
    One,
    PairLimit,
    Rule,
    Seed,
    Text,
    TopLogprobs,
    bounded,
    ignored,
    mapped,
    passed,
    refused,
    router,
)

REASONING_SPLIT = "true: split by the decode's parser"
OPENAI_SERVICE = "OpenAI's own service; nothing here acts on it"

# A chat message. Non-text parts are refused with the fields that need them. OpenAI's own fields of an assistant
# message are those its clients send back as they got them (openai-python's `message.model_dump()`): SGLang drops
# them, so each is decided as what it meant (router/checks/chat_checks.py's `assistant_fields`).
MESSAGE: dict[str, Rule] = {
    "role": bounded("system, user, assistant, developer, tool; function (deprecated): sent as a tool message "
                    "answering the function_call before it",
                    Literal["system", "user", "assistant", "developer", "tool", "function"]),
    "content": bounded("text, or a list of text parts (or none beside tool_calls)", Content),
    "name": passed("", Name | None),
    "tool_calls": bounded(f"an assistant's: at most {MAX_TOOLS}, arguments a JSON object as text",
                          Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)], PairLimit.TOOL_PARSER),
    "tool_call_id": bounded("a tool message's: the call it answers", CallId, PairLimit.TOOL_PARSER),
    "function_call": mapped("deprecated: sent as the assistant's one tool call, id function_call_1 in messages[1]",
                            CalledFunction, PairLimit.TOOL_PARSER),
    "refusal": mapped("sent as the content of an assistant's turn without one, else left out", StrictStr),
    "reasoning_content": passed("an assistant's, as SGLang's reasoning parser answered it", StrictStr,
                                PairLimit.REASONING_PARSER),
    "annotations": ignored("an assistant's citations: no template renders them", list[dict[str, Any]]),
    "audio": refused("an audio answer OpenAI keeps by id: a text model has none; send its transcript as content"),
    "tools": refused("one model family's: use the request's tools"),
    "phase": refused(REASONING),
    "prefix": refused("continues a message the model wrote: use continue_final_message"),
}

# Fields both OpenAI routes share, with the native rule of the same meaning.
COMMON: dict[str, Rule] = {
    "model": passed("a served model's name or path (another: a 404)", Name | None),
    "frequency_penalty": SAMPLING["frequency_penalty"],
    "presence_penalty": SAMPLING["presence_penalty"],
    "logit_bias": SAMPLING["logit_bias"],
    "n": bounded("one PD request per choice, the first's cached prompt reused; at most the router's max_n (8 by "
                 "default)", Choices | None),
    "stop": SAMPLING["stop"],
    "stream": passed("", Flag),
    "stream_options": passed("include_usage, continuous_usage_stats; only with stream true, as OpenAI has it",
                             StreamOptions | None),
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "top_k": SAMPLING["top_k"],
    "min_p": SAMPLING["min_p"],
    "min_tokens": bounded("as min_new_tokens", Count | None, PairLimit.TOKENS),
    "max_tokens": bounded("as max_new_tokens", Count | None, PairLimit.TOKENS),
    "repetition_penalty": SAMPLING["repetition_penalty"],
    "stop_token_ids": SAMPLING["stop_token_ids"],
    "stop_regex": SAMPLING["stop_regex"],
    "no_stop_trim": SAMPLING["no_stop_trim"],
    "ignore_eos": SAMPLING["ignore_eos"],
    "skip_special_tokens": SAMPLING["skip_special_tokens"],
    "regex": SAMPLING["regex"],
    "ebnf": SAMPLING["ebnf"],
    "seed": bounded("as sampling_seed; system_fingerprint says which: pdcluster-deterministic or "
                    "pdcluster-best-effort", Seed | None),
    "user": passed("an end-user id, logged by nobody", Name | None),
    "response_format": bounded("text, json_object, or json_schema (a grammar)", ResponseFormat | None),
    "rid": router("the client's id, logged; SGLang gets a fresh id of the router's", ClientId | None),
    "return_token_ids": passed("", Flag),
    "return_cached_tokens_details": passed("", Flag),
    "return_spec_tokens_details": refused("speculative decoding internals", default=False),
    "return_hidden_states": GENERATE["return_hidden_states"],
    "return_routed_experts": GENERATE["return_routed_experts"],
    "routed_experts_start_len": GENERATE["routed_experts_start_len"],
    "custom_params": SAMPLING["custom_params"],
    "custom_logit_processor": GENERATE["custom_logit_processor"],
    "watermark": SAMPLING["watermark"],
    "lora_path": GENERATE["lora_path"],
    "session_id": GENERATE["session_id"],
    "session_params": GENERATE["session_params"],
    "images_config": refused(MULTIMODAL),
    "mm_processor_kwargs": refused(MULTIMODAL),
    "bootstrap_host": refused(ROUTER_PD),
    "bootstrap_port": refused(ROUTER_PD),
    "bootstrap_room": refused(ROUTER_PD),
    "routed_dp_rank": refused(DP),
    "data_parallel_rank": refused(DP),
    "disagg_prefill_dp_rank": refused(DP),
    "extra_key": refused(CACHE_KEY),
    "cache_salt": refused(CACHE_KEY),
    "priority": GENERATE["priority"],
}

CHAT: dict[str, Rule] = {
    **COMMON,
    "messages": bounded("1 to 1024 messages, each as in the message table", Annotated[
        list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]),
    "logprobs": passed("", Flag),
    "top_logprobs": bounded("0 to 20, as OpenAI's", TopLogprobs | None),
    "max_completion_tokens": bounded("as max_new_tokens", Count | None, PairLimit.TOKENS),
    "continue_final_message": passed("the answer continues the last (assistant) message", Flag),
    "return_prompt_token_ids": passed("", Flag),
    "return_meta_info": passed("", Flag),
    "return_input_ids_in_sglext": passed("", Flag),
    "return_output_ids_in_sglext": passed("", Flag),
    "separate_reasoning": passed(REASONING_SPLIT, Flag, PairLimit.REASONING_PARSER),
    "stream_reasoning": passed(REASONING_SPLIT, Flag, PairLimit.REASONING_PARSER),
    "tools": bounded(f"at most {MAX_TOOLS} functions; their parameters schemas together are a grammar",
                     Annotated[list[Tool], Field(max_length=MAX_TOOLS)], PairLimit.TOOL_PARSER),
    "tool_choice": bounded("none, auto, required or a named function (of tools)", ToolChoice),
    "parallel_tool_calls": passed("", Flag),
    "functions": mapped("deprecated tools; answered as function_call",
                        Annotated[list[ToolFunction], Field(max_length=MAX_TOOLS)], PairLimit.TOOL_PARSER),
    "function_call": mapped("deprecated tool_choice", Literal["none", "auto"] | FunctionName),
    # Fields today's OpenAI clients send that SGLang does not know: accepted, and never sent on.
    "store": ignored(OPENAI_SERVICE + " (nothing is stored)", Flag | None),
    "metadata": ignored(OPENAI_SERVICE + " (tags for OpenAI's stored completions)", Metadata | None),
    "service_tier": ignored(OPENAI_SERVICE + " (one tier)",
                            Literal["auto", "default", "flex", "scale", "priority"] | None),
    "prompt_cache_key": ignored("OpenAI's hint for its cache; the router's policy decides, and a client's key never"
                                " steers another client's request", Name | None),
    "safety_identifier": ignored(OPENAI_SERVICE + " (an end-user id for its abuse checks)", Name | None),
    "verbosity": ignored("a setting of OpenAI's reasoning models", Literal["low", "medium", "high"] | None),
    "chat_template_kwargs": bounded("only SGLang's reasoning switches, enable_thinking and thinking, as booleans: "
                                    "other values reached the template engine and failed there",
                                    ThinkingSwitches | None, PairLimit.REASONING_PARSER),
    "reasoning_effort": bounded("none, minimal, low, medium or high",
                                Literal["none", "minimal", "low", "medium", "high"] | None, PairLimit.REASONING_EFFORT),
    "thinking": refused(REASONING + "; it reaches the chat template"),
    "task": refused("a task tag of one model family's chat template"),
    "return_sampling_mask": refused("per-token sampling support: large answers the router does not merge",
                                    default=False),
    "sampling_logprobs_mode": GENERATE["sampling_logprobs_mode"],
    "return_flat_raw_output_top_logprobs": refused("another logprob layout", default=False),
    "return_flat_raw_top_logprobs_b64": refused("another logprob layout", default=True),
    "input_ids": refused("a chat is its messages: send token ids to /v1/completions or /generate"),
    "max_dynamic_patch": refused(MULTIMODAL),
    "min_dynamic_patch": refused(MULTIMODAL),
    "use_audio_in_video": refused(MULTIMODAL, default=False),
    "video_config": refused(MULTIMODAL),
}

COMPLETION: dict[str, Rule] = {
    **COMMON,
    # Shape: text, a batch of texts, token ids or a batch of them; ids are checked against the pair.
    "prompt": bounded("text, texts, or token ids in the vocabulary", Text | Prompts | Annotated[
        list[Any], Field(min_length=1, max_length=2**24)], PairLimit.TOKEN_IDS),
    "best_of": bounded("1 only: every choice is returned", One | None),
    "echo": passed("the text starts with the prompt; with logprobs, the prompt's too (the prefill's, merged)", Flag),
    "logprobs": bounded("0 to 20 top logprobs per token; text_offset counts from the text's start",
                        TopLogprobs | None),
    "max_tokens": bounded("as max_new_tokens, at least 1; 0 with echo and logprobs: the prompt scored alone, "
                          "answered whole", Count | None, PairLimit.TOKENS),
    "suffix": refused("insertion (fill in the middle) is not supported by SGLang"),
    "json_schema": SAMPLING["json_schema"],
    "custom_labels": GENERATE["custom_labels"],
}
