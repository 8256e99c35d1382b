"""The model shape, read from a Hugging Face `config.json` (the GGUF path writes one too)."""

from __future__ import annotations

import dataclasses
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
    "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
)  # fmt: skip
# vision-language models: their language model is one of the families above, read from `text_config`
VISION_ARCHITECTURES = frozenset({"LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"})
# a text_config's model_type -> the family that runs it (when it names no architectures)
_TEXT_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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
    # the whole config.json: the family reads its own keys (norm kinds, soft-caps, experts, ...); a
    # vision-language model's text_config (with transformers' defaults filled in)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # a vision-language model's whole config.json (vision_config, image token, projector); None: text only
    vision: dict[str, Any] | None = field(default=None, compare=False, repr=False)

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
        if arch in VISION_ARCHITECTURES:
            text = cls.from_dict(text_config(cfg))
            return dataclasses.replace(text, architecture=arch, vision=cfg)
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


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's `text_config`, complete: a saved config keeps only the values that
    differ from its class's defaults (llava-1.5-7b-hf's names no hidden_size), so transformers' config
    class of its model_type fills in the rest; `architectures` names the family that runs it."""
    from transformers import AutoConfig  # only for vision-language models: a second to import

    text = dict(cfg.get("text_config") or {})
    kind = text.get("model_type", "llama")
    family = (text.get("architectures") or [_TEXT_FAMILIES.get(kind, "")])[0]
    if family not in SUPPORTED_ARCHITECTURES or family in VISION_ARCHITECTURES:
        raise ValueError(
            f"unsupported language model {kind!r} in text_config; supported: {', '.join(_TEXT_FAMILIES)}"
        )
    full = AutoConfig.for_model(kind, **{k: v for k, v in text.items() if k != "model_type"}).to_dict()
    return {**full, "architectures": [family]}


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
