"""Llama family (Llama 2/3, SmolLM/SmolLM2, Mistral): our own forward over the token-level KV pool.

Numerics follow transformers' LlamaForCausalLM (RMSNorm in fp32, rotate-half RoPE, SwiGLU, GQA) so
greedy output matches it token for token in fp32. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.attention.base import AttentionBackend
from services.scheduler.forward_batch import ForwardBatch, LogitsOutput
from services.scheduler.models.ops import TorchOps, TritonOps
from services.scheduler.rotary import Rotary
from shared.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layer = layer
        h, d = config.hidden_size, config.head_dim
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h, dtype=dtype))
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size, dtype=dtype))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.intermediate_size, h, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(h, config.intermediate_size, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch, ctx: _Context
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings for layer 0), residual: the stream it adds
        to (None for layer 0). Returns this layer's output and the residual stream before it."""
        ops, t = ctx.ops, x.shape[0]
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        qkv = F.linear(h, self.qkv_proj)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k, v = k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim)
        o = ctx.attn.forward(q, k, v, self.layer, fb, ctx.rotary)  # rotates q and k (RoPE) as it stores
        o = F.linear(o.reshape(t, self.q_size), self.o_proj)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(o, residual, norm.weight, norm.eps)
        return F.linear(ops.gate_up_silu(h, self.gate_up_proj), self.down_proj), residual


@dataclass
class _Context:
    ops: TorchOps | TritonOps
    rotary: Rotary
    attn: AttentionBackend


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype | None = None) -> None:
        """dtype: the parameters' (made in it from the start); the RoPE tables stay float32."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        )
        self.rotary = Rotary(config, max_positions)
        self.ops: TorchOps | TritonOps = TorchOps()

    def set_ops(self, ops: TorchOps | TritonOps) -> None:
        self.ops = ops

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, attn: AttentionBackend, logits_out: torch.Tensor | None = None
    ) -> LogitsOutput:
        """Logits (in the model's dtype) for the tokens that sample (fb.logits_idx; every token when
        None), and the final hidden states of fb.lp_idx for prompt logprobs (turned into logits later,
        in slices). logits_out: write the logits there (the CUDA graphs' one static buffer) instead of
        a new tensor."""
        ctx = _Context(self.ops, self.rotary, attn)
        x, residual = F.embedding(fb.input_ids, self.embed_tokens), None
        for layer in self.layers:
            x, residual = layer(x, residual, fb, ctx)
        x = x + residual
        lp_hidden = None
        if fb.lp_idx is not None:
            lp_hidden = self.ops.rms_norm(x[fb.lp_idx], self.norm.weight, self.norm.eps)
        last = x if fb.logits_idx is None else x[fb.logits_idx]
        hidden = self.ops.rms_norm(last, self.norm.weight, self.norm.eps)
        return LogitsOutput(self.logits(hidden, logits_out), lp_hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states [N, H] -> logits [N, vocab] in the model's dtype (into `out` when
        given). They stay in it: a greedy draw reads them as they are (the argmax of a bf16 row is the
        argmax of its float32 copy), and SampleStep makes the float32 copy only for a batch whose
        processors or draw need one; on an H200 at ~2,400 rows of a 128k vocabulary that copy was a
        1.2 GB write every step."""
        if out is None:
            return F.linear(hidden, self.lm_head)
        return torch.mm(hidden, self.lm_head.t(), out=out)

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
