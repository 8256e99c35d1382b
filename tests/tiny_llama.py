"""A tiny Llama config.json for random-weight test models (`shared.model_files.write_dummy_folder`),
with the default model's vocabulary so its tokenizer fits."""

from __future__ import annotations

from typing import Any


def tiny_llama(**overrides: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2,
        **overrides,
    }  # fmt: skip
