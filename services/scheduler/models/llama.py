"""Llama family (Llama 2/3, SmolLM/SmolLM2, Mistral): our own forward over the token-level KV pool.

Numerics follow transformers' LlamaForCausalLM (RMSNorm in fp32, rotate-half RoPE, SwiGLU, GQA) so
greedy output matches it token for token in fp32. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.attention.base import AttentionBackend
from services.scheduler.forward_batch import ForwardBatch
from shared.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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


class Rotary(nn.Module):
    """cos/sin for every position up to the context length, computed once as transformers does."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # plain attributes, not buffers: model.to(bf16) must not round them
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, d = config.hidden_size, config.head_dim
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h))
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.intermediate_size, h))
        self.down_proj = nn.Parameter(torch.empty(h, config.intermediate_size))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        attn: AttentionBackend,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = F.linear(self.input_layernorm(x), self.qkv_proj)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k, positions)
        o = attn.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim), self.layer, fb)
        x = x + F.linear(o.reshape(t, self.q_size), self.o_proj)
        gate, up = F.linear(self.post_attention_layernorm(x), self.gate_up_proj).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        self.rotary = Rotary(config, max_positions)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Returns float32 logits [len(fb.logits_idx), vocab] for the tokens that sample; keeps the final
        hidden states of `fb.lp_idx` in `fb.lp_hidden` (prompt logprobs, turned into logits later)."""
        x = F.embedding(fb.input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, fb.positions, self.rotary, attn, fb)
        if fb.lp_idx is not None:
            fb.lp_hidden = self.norm(x[fb.lp_idx])
        return self.logits(self.norm(x[fb.logits_idx]))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [N, H] -> float32 logits [N, vocab]."""
        return F.linear(hidden, self.lm_head).float()

    # -- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take transformers' parameter names; fuse q/k/v and gate/up as they arrive."""
        pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        fused = {
            "self_attn.q_proj": ("qkv_proj", "q"),
            "self_attn.k_proj": ("qkv_proj", "k"),
            "self_attn.v_proj": ("qkv_proj", "v"),
            "mlp.gate_proj": ("gate_up_proj", "gate"),
            "mlp.up_proj": ("gate_up_proj", "up"),
        }
        parts = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "embed_tokens.weight":
                self._copy(self.embed_tokens, tensor)
            elif name == "lm_head.weight":
                if not self.config.tie_word_embeddings:
                    self._copy(self.lm_head, tensor)
            elif name == "norm.weight":
                self._copy(self.norm.weight, tensor)
            elif name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                layer = self.layers[int(idx)]
                rest = rest.removesuffix(".weight")
                if rest in fused:
                    target, part = fused[rest]
                    group = pending.setdefault((int(idx), target), {})
                    group[part] = tensor
                    if len(group) == len(parts[target]):
                        self._copy(getattr(layer, target), torch.cat([group[p] for p in parts[target]]))
                        del pending[(int(idx), target)]
                        name = f"layers.{idx}.{target}"
                    else:
                        continue
                elif rest == "self_attn.o_proj":
                    self._copy(layer.o_proj, tensor)
                elif rest == "mlp.down_proj":
                    self._copy(layer.down_proj, tensor)
                elif rest in ("input_layernorm", "post_attention_layernorm"):
                    self._copy(getattr(layer, rest).weight, tensor)
                elif "rotary_emb" in rest:
                    continue
                else:
                    raise ValueError(f"unexpected weight {name!r}")
            else:
                raise ValueError(f"unexpected weight {name!r}")
            loaded.add(name)
        expected = 3 + 6 * len(self.layers) - (1 if self.config.tie_word_embeddings else 0)
        if pending or len(loaded) != expected:
            raise ValueError(
                f"incomplete weights: loaded {len(loaded)} of {expected} tensors; partial: {list(pending)}"
            )

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor) -> None:
        if param.shape != tensor.shape:
            raise ValueError(
                f"weight shape {tuple(tensor.shape)} does not fit parameter {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)

    def init_dummy(self, seed: int) -> None:
        """Random weights (for benchmarks of shapes whose weights are not on the machine)."""
        gen = torch.Generator(device=self.embed_tokens.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
