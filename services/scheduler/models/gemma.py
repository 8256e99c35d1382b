"""Gemma 2 and Gemma 3 (text): Llama's layers with
- RMSNorms that scale by (1 + w), four per layer (before and after attention and the MLP);
- GeGLU (gelu-tanh gate), embeddings scaled by sqrt(hidden), scores scaled by
  query_pre_attn_scalar ** -0.5, the LM head tied to the embeddings;
- local (sliding window) and global layers interleaved: Gemma 2 every other layer, Gemma 3 five
  local to one global (`layer_types`, else `sliding_window_pattern`), with their own RoPE base
  (Gemma 3: `rope_local_base_freq`, and scaling on the global layers only);
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: RMSNorm (1 + w) on each head of q and k before RoPE."""

from __future__ import annotations

from services.scheduler.models.decoder import FULL, SLIDING, Arch, CausalLM
from services.scheduler.models.layers import activation_of
from shared.model_config import ModelConfig


def _gemma(config: ModelConfig, every: int, qk_norm: bool) -> Arch:
    """every: one global layer per this many (the others slide) unless config.json lists them."""
    raw = config.raw
    types = raw.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(config.num_layers)]
    return Arch(
        tuple(types), window=raw.get("sliding_window") or 0, qk_norm=qk_norm, norm_offset=1.0,
        sandwich=True, act=activation_of(raw), embed_scale=True,
        attn_scale=raw.get("query_pre_attn_scalar", config.head_dim) ** -0.5,
        attn_softcap=raw.get("attn_logit_softcapping") or 0.0,
        final_softcap=raw.get("final_logit_softcapping") or 0.0,
    )  # fmt: skip


class Gemma2ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        return _gemma(config, every=2, qk_norm=False)


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        pattern = config.raw.get("sliding_window_pattern") or config.raw.get("_sliding_window_pattern") or 6
        return _gemma(config, every=pattern, qk_norm=True)
