"""The request schema of SGLang's `/generate`, as read from one SGLang release: every field of
`GenerateReqInput` (python/sglang/srt/managers/io_struct.py) and every keyword of `SamplingParams`
(python/sglang/srt/sampling/sampling_params.py), each with SGLang's default.

These are the names the server accepts. The fields it honours are parsed by their own modules
(services/gateway/generate_input.py, logprob_options.py, shared/sampling_params.py); every other one
is accepted only at its default here (or null), and refused by name otherwise. To follow a new SGLang
release, read its two files and update both dicts and `SGLANG_VERSION` together."""

from __future__ import annotations

from typing import Any

SGLANG_VERSION = "0.5.23"

# GenerateReqInput's fields, in SGLang's order, and their defaults
GENERATE_REQ_INPUT: dict[str, Any] = {
    "rid": None,
    "session_id": None,
    "text": None,
    "input_ids": None,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "sampling_params": None,
    "watermark": None,
    "return_logprob": None,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "token_ids_logprob": None,
    "return_sampling_mask": None,
    "sampling_logprobs_mode": None,
    "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "routed_dp_rank": None,
    "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None,
    "routing_key": None,
    "conversation_id": None,
    "http_worker_ipc": None,
    "background": False,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "priority": None,
    "extra_key": None,
    "no_logs": False,
    "custom_labels": None,
    "return_bytes": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "external_trace_header": None,
    "received_time": None,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
    "cache_salt": None,
    "kv_hints": None,
}

# SamplingParams' constructor keywords, in SGLang's order, and their defaults; the last six are
# SGLang's internal fields (filled by its own normalization), keywords all the same
SAMPLING_PARAMS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 1 << 30,  # TOP_K_ALL: the whole vocabulary (-1 means the same)
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
    "custom_params": None,
    "watermark": None,
    "stop_strs": None,
    "stop_regex_strs": None,
    "stop_str_max_len": 0,
    "stop_regex_max_len": 0,
    "is_normalized": False,
    "ebnf_full_assistant": False,
}


def is_default(value: Any, default: Any) -> bool:
    """Whether a client's value for a field means its default: null, the default itself, or a list of
    those (one per prompt of a batch; an empty list too)."""
    if value is None or value == default:
        return True
    return isinstance(value, list) and all(v is None or v == default for v in value)
