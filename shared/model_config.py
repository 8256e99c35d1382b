"""The model shape, read from a Hugging Face `config.json` (the GGUF path writes one too)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# families whose configs tie the LM head to the embeddings unless they say otherwise
TIED_BY_DEFAULT = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})
# architectures[0] of config.json -> the family that runs it (services/scheduler/models/)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # HF's rope_scaling dict (llama3, linear, ...) or None
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    # the whole config.json: the family reads its own keys (norm kinds, soft-caps, experts, ...)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling = rope_settings(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in TIED_BY_DEFAULT)),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window"),
            raw=cfg,
        )

    def rope(self, layer_type: str = "full_attention") -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of the layers of this type (Gemma 3's sliding layers have their own)."""
        return rope_settings(self.raw, layer_type) if self.raw else (self.rope_theta, self.rope_scaling)

    @classmethod
    def from_folder(cls, folder: str) -> ModelConfig:
        with open(os.path.join(folder, "config.json")) as f:
            return cls.from_dict(json.load(f))


def rope_settings(
    cfg: dict[str, Any], layer_type: str = "full_attention"
) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, rope scaling or None) from config.json: transformers 4's `rope_theta` /
    `rope_scaling` (Gemma 3: `rope_local_base_freq` for its sliding layers, unscaled), or transformers
    5's `rope_parameters`, flat or per layer type. The scaling dict always names its `rope_type`."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        params = params.get(layer_type) or params.get("full_attention") or {}
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        return float(cfg["rope_local_base_freq"]), None
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return theta, scaling
