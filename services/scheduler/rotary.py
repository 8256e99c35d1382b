"""Rotate-half RoPE (every family here): the cos/sin tables, and the torch reference rotation.

The model builds one `Rotary`; every layer hands its q and k, not yet rotated, to the attention
backend together with it, and the backend rotates them where it stores the keys: the torch backend
with `Rotary.rotate` (transformers' numerics, so fp32 greedy output matches HF), the triton backend
in the kernel that writes the pool (sglbus_kernels/rope.py `rope_store_kv`: q rotated in place, k rotated on
its way into its slot, v copied; one launch and one read of k instead of a RoPE pass and a store).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shared.model_config import ModelConfig


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], the factor cos and sin are multiplied by), as
    transformers' rope functions compute them for the scalings the families use: linear (Gemma 3's
    global layers), llama3, yarn (Qwen2.5 / Qwen3 long context)."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(d, theta, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3, yarn")


def _yarn(d: int, theta: float, scaling: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated frequencies for the slow dimensions, the original ones for the fast, a linear
    ramp between (beta_fast / beta_slow rotations over the original context), and cos/sin scaled by
    0.1 ln(factor) + 1 (or the config's attention_factor / mscale pair)."""
    old_ctx = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor") or max_pos / old_ctx

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


class Rotary:
    """cos/sin [max_positions, D] for every position up to the context length, computed once as
    transformers does; fp32 plain tensors (not parameters or buffers: model.to(bf16) must not round
    them). The two halves of a row are equal (`cat((freqs, freqs), -1)`). A model has one per kind
    of layer (Gemma 3's sliding layers rotate with their own base)."""

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
        max_position_embeddings: int,
    ) -> None:  # fmt: skip
        inv_freq, factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * factor, emb.sin() * factor

    @classmethod
    def of(cls, config: ModelConfig, max_positions: int, layer_type: str = "full_attention") -> Rotary:
        theta, scaling = config.rope(layer_type)
        return cls(config.head_dim, theta, scaling, max_positions, config.max_position_embeddings)

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
