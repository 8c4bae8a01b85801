"""SGLang's native API: every field of `GenerateReqInput` (sglang/srt/managers/io_struct.py) and of `SamplingParams`
(sglang/srt/sampling/sampling_params.py), decided. tests/unit/test_inventory.py fails when SGLang's own lists and
these differ, so an upgrade shows up as a diff here."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from router.checks.inventory.rules import (
    MAX_BATCH,
    ClientId,
    Count,
    Flag,
    Grammar,
    LogitBias,
    LogprobStart,
    MinP,
    One,
    PairLimit,
    Penalty,
    RepetitionPenalty,
    Rule,
    Seed,
    Stop,
    StreamInterval,
    Temperature,
    Text,
    TokenIds,
    TopK,
    TopLogprobs,
    TopP,
    bounded,
    passed,
    refused,
    router,
)

MULTIMODAL = "multimodal input: these workers serve a text model, and an image or audio URL would make them fetch it"
INTERNAL = "set inside SGLang (by its tokenizer manager or engine), never by a client"
NOT_PD = "not served through a PD pair"
ROUTER_PD = "set by the router: the prefill that serves the request and a fresh room per attempt"
DP = "a data-parallel rank out of range crashes the scheduler; the router does not route by rank"
CACHE_KEY = ("a cache namespace: SGLang's HiCache storage keys ignore it (sglang #26747), so it would not isolate "
             "what KV persistence stores")
SCORING = "for SGLang's scoring API, not generation"
REASONING = "for hybrid reasoning models only"
GRAMMAR = "a grammar, compiled on both workers: size-limited"

Prompts = Annotated[list[Text], Field(min_length=1, max_length=MAX_BATCH)]
# Shape only: a list of ids or a batch of lists; each id is checked against the pair (router/checks/validation.py).
IdPrompts = Annotated[list[Any], Field(min_length=1)]

SAMPLING: dict[str, Rule] = {
    "max_new_tokens": bounded("tokens to generate", Count | None, PairLimit.TOKENS),
    "min_new_tokens": bounded("at most max_new_tokens (SGLang checks that)", Count | None, PairLimit.TOKENS),
    "stop": bounded("stop strings", Stop | None),
    "stop_token_ids": bounded("an id out of the vocabulary crashes the scheduler once min_new_tokens > 0",
                              TokenIds | None, PairLimit.TOKEN_IDS),
    "stop_regex": refused("matched by Python's backtracking `re` on the scheduler after every token: a pattern can "
                          "take exponential time and stall every request on the worker"),
    "temperature": bounded("finite, >= 0", Temperature | None),
    "top_p": bounded("in (0, 1]", TopP | None),
    "top_k": bounded("-1 or >= 1; 2**63 crashed the scheduler", TopK | None),
    "min_p": bounded("in [0, 1]", MinP | None),
    "frequency_penalty": bounded("in [-2, 2]", Penalty | None),
    "presence_penalty": bounded("in [-2, 2]", Penalty | None),
    "repetition_penalty": bounded("in [0.01, 2]: a penalty near 0 divides logits to infinity (1e-300 crashed the "
                                                     "decode)", RepetitionPenalty | None),
    "n": bounded("1 only: the OpenAI routes serve more (here, send n requests)", One | None),
    "beam_width": refused("beam search: " + NOT_PD),
    "json_schema": bounded(GRAMMAR, Grammar | None),
    "regex": bounded(GRAMMAR, Grammar | None),
    "ebnf": bounded(GRAMMAR, Grammar | None),
    "structural_tag": bounded(GRAMMAR, Grammar | None),
    "ignore_eos": passed("", Flag | None),
    "skip_special_tokens": passed("", Flag | None),
    "spaces_between_special_tokens": passed("", Flag | None),
    "no_stop_trim": passed("", Flag | None),
    "stream_interval": bounded("tokens per streamed event, 1 to 1024", StreamInterval | None),
    "logit_bias": bounded("token ids (decimal strings) in the vocabulary, biases in [-100, 100]", LogitBias | None,
                          PairLimit.TOKEN_IDS),
    "sampling_seed": bounded("a non-negative 64-bit integer: reproducible under any load on a pair that runs "
                             "deterministic inference, on CPU workers when idle (their seeded sampler: "
                             "pdcluster/plugins/cpu_seeded_sampling)", Seed | None),
    "custom_params": refused("read only by custom logit processors (refused), and SGLang keeps private keys in it"),
    "watermark": refused("watermarking is configured on the server, not per request"),
    # SGLang's internal state, filled in by its normalize(): a client's value would skip that.
    "stop_strs": refused(INTERNAL),
    "stop_regex_strs": refused(INTERNAL),
    "stop_str_max_len": refused(INTERNAL, default=0),
    "stop_regex_max_len": refused(INTERNAL, default=0),
    "is_normalized": refused(INTERNAL, default=False),
    "ebnf_full_assistant": refused(INTERNAL, default=False),
}

SamplingParamsType = dict[str, Any] | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BATCH)]

GENERATE: dict[str, Rule] = {
    "text": bounded("the prompt, or a batch of prompts (non-empty)", Text | Prompts | None),
    "input_ids": bounded("an id out of the vocabulary crashes the scheduler (SGLang indexes its embedding unchecked)",
                         IdPrompts | None, PairLimit.TOKEN_IDS),
    "input_embeds": refused("embeddings bypass the vocabulary check, and their width must match the model's"),
    "sampling_params": bounded("each field as in the sampling_params table; a list: one per batch item",
                               SamplingParamsType | None),
    "stream": passed("", Flag),
    "rid": router("the client's id, logged; SGLang gets a fresh id of the router's (it aborts by rid prefix)",
                  ClientId | None),
    "return_logprob": passed("one value for the whole request", Flag | None),
    "logprob_start_len": bounded("-1 (output only) or a prompt position; -5 crashed the scheduler", LogprobStart | None,
                                 PairLimit.POSITION),
    "top_logprobs_num": bounded("one value, 0 to 20: 2000 (over the demo model's vocabulary) and 10**9 crashed the "
                                "scheduler", TopLogprobs | None),
    "token_ids_logprob": bounded("one list of ids in the vocabulary", TokenIds | None, PairLimit.TOKEN_IDS),
    "return_text_in_logprobs": passed("", Flag),
    "no_logs": passed("asks the workers not to log the request's content", Flag),
    "return_prompt_token_ids": passed("", Flag),
    "return_sampling_mask": refused("per-token sampling support: large answers the router does not merge"),
    "sampling_logprobs_mode": refused("per-token sampling support: large answers the router does not merge"),
    "return_flat_raw_top_logprobs": refused("another logprob layout, which the router's merge of the prefill's "
                                            "input logprobs does not read", default=False),
    "return_flat_raw_output_top_logprobs": refused("another logprob layout (see return_flat_raw_top_logprobs)",
                                                   default=False),
    "return_flat_raw_top_logprobs_b64": refused("another logprob layout (see return_flat_raw_top_logprobs)",
                                                default=False),
    "return_hidden_states": refused("needs --enable-return-hidden-states on both workers; large answers",
                                    default=False),
    "return_routed_experts": refused("mixture-of-experts internals", default=False),
    "routed_experts_start_len": refused("mixture-of-experts internals", default=0),
    "return_indexer_topk": refused("sparse-attention internals", default=False),
    "return_entropy": refused("not merged across the two halves of a PD pair", default=False),
    "return_bytes": refused(INTERNAL, default=False),
    "log_metrics": refused(INTERNAL + " (health checks turn it off)", default=True),
    "image_data": refused(MULTIMODAL),
    "video_data": refused(MULTIMODAL),
    "audio_data": refused(MULTIMODAL),
    "mm_hashes": refused(MULTIMODAL),
    "mm_content_hashes": refused(MULTIMODAL),
    "use_audio_in_video": refused(MULTIMODAL, default=False),
    "video_config": refused(MULTIMODAL),
    "modalities": refused(MULTIMODAL),
    "max_dynamic_patch": refused(MULTIMODAL),
    "min_dynamic_patch": refused(MULTIMODAL),
    "image_max_dynamic_patch": refused(MULTIMODAL),
    "video_max_dynamic_patch": refused(MULTIMODAL),
    "images_config": refused(MULTIMODAL),
    "mm_processor_kwargs": refused(MULTIMODAL),
    "positional_embed_overrides": refused("embeddings placed at positions: bypass the vocabulary check"),
    "watermark": refused("watermarking is configured on the server, not per request"),
    "session_id": refused("sessions keep state on one worker; a PD pair is chosen per request"),
    "session_params": refused("sessions keep state on one worker; a PD pair is chosen per request"),
    "lora_path": refused("no LoRA adapters are served, and a path names a file on the worker"),
    "lora_id": refused(INTERNAL),
    "custom_logit_processor": refused("serialized Python code run on the worker"),
    "bootstrap_host": refused(ROUTER_PD),
    "bootstrap_port": refused(ROUTER_PD),
    "bootstrap_room": refused(ROUTER_PD),
    "bootstrap_pair_key": refused(ROUTER_PD),
    "decode_tp_size": refused(ROUTER_PD),
    "routed_dp_rank": refused(DP),
    "data_parallel_rank": refused(DP),
    "disagg_prefill_dp_rank": refused(DP),
    "routing_key": refused("read by a scheduling policy these workers do not run"),
    "conversation_id": refused("a tracking id: send X-Request-ID, which the router logs and echoes"),
    "http_worker_ipc": refused(INTERNAL),
    "background": refused("for the OpenAI Responses API, which the router does not serve", default=False),
    "require_reasoning": refused(REASONING, default=False),
    "max_thinking_tokens": refused(REASONING),
    "priority": refused("a client must not choose its own priority (and it needs priority scheduling on)"),
    "extra_key": refused(CACHE_KEY),
    "cache_salt": refused(CACHE_KEY),
    "custom_labels": refused("metric labels chosen by clients would grow the workers' metrics without bound"),
    "external_trace_header": refused(INTERNAL),
    "received_time": refused(INTERNAL),
    "need_wait_for_mm_inputs": refused(INTERNAL + " (encoder disaggregation)"),
    "num_items_assigned": refused(INTERNAL + " (encoder disaggregation)"),
    "encoder_urls": refused(INTERNAL + " (encoder disaggregation): it would make the workers contact URLs"),
    "multi_item_delimiter_indices": refused(SCORING),
    "token_indices_to_pool": refused(SCORING),
    "kv_hints": refused("set by a trusted orchestrator, never by an application client (SGLang's own words)"),
}
