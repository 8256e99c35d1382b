"""Llama (Llama 2 / 3, SmolLM / SmolLM2): pre-norm layers, SwiGLU, GQA, rotate-half RoPE (llama3 or
linear scaling); the shape every other family here varies."""

from __future__ import annotations

from services.scheduler.models.decoder import Arch, CausalLM, layer_types
from shared.model_config import ModelConfig


class LlamaForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        return Arch(layer_types(config, sliding=False), bias=bool(config.raw.get("attention_bias")))
