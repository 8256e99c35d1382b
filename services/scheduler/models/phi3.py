"""Phi-3 (mini, medium): Llama's layers with q/k/v fused into one `qkv_proj` and gate/up into one
`gate_up_proj` in the checkpoint, and a sliding window on every layer where `sliding_window` is set
(Phi-3-mini-4k: 2,047). Partial rotary (Phi-4-mini) and longrope scaling (the 128k models) are not
supported: the model refuses to start."""

from __future__ import annotations

from services.scheduler.models.decoder import Arch, CausalLM, layer_types
from shared.model_config import ModelConfig


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        window = config.raw.get("sliding_window") or 0
        return Arch(layer_types(config, sliding=bool(window)), window=window, fused_checkpoint=True)
