"""Rotate-half RoPE (the Llama family): the cos/sin tables, and the torch reference rotation.

The model builds one `Rotary`; every layer hands its q and k, not yet rotated, to the attention
backend together with it, and the backend rotates them where it stores the keys: the torch backend
with `Rotary.rotate` (transformers' numerics, so fp32 greedy output matches HF), the triton backend
in the kernel that writes the pool (sglbus_kernels/rope.py `rope_store_kv`: q rotated in place, k rotated on
its way into its slot, v copied; one launch and one read of k instead of a RoPE pass and a store).
"""

from __future__ import annotations

import math

import torch

from shared.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")


class Rotary:
    """cos/sin [max_positions, D] for every position up to the context length, computed once as
    transformers does; fp32 plain tensors (not parameters or buffers: model.to(bf16) must not round
    them). The two halves of a row are equal (`cat((freqs, freqs), -1)`)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> new tensors x*cos[pos] + rotate_half(x)*sin[pos], with cos and
        sin rounded to the input dtype first, as transformers' LlamaRotaryEmbedding does."""
        cos, sin = self.cos, self.sin
        return rotate_half_rope(q, cos, sin, positions), rotate_half_rope(k, cos, sin, positions)


def rotate_half_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    c = cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D]
    s = sin[positions].unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s
