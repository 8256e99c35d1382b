"""The parts every family's decoder layer is made of: RMSNorm, the attention block (fused q/k/v,
optional bias and per-head q/k norms, the layer's RoPE, window and soft-cap handed to the backend),
the gated MLP (SwiGLU or GeGLU) and the weight pieces each part takes from a checkpoint.

Parameters are made with `torch.empty` in the model's dtype (filled by the loader or `init_dummy`);
fused parameters (q/k/v, gate/up, the experts' stacks) take their checkpoint tensors as slices
(`Piece`), so a family maps names and nothing is concatenated while loading."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.attention.base import AttentionBackend, LayerAttention
from services.scheduler.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from services.scheduler.models.ops import TorchOps, TritonOps


@dataclass
class Piece:
    """Where one checkpoint tensor goes: `param[index]`, plus `add` (Gemma's norms store w for a
    scale of 1 + w: the sum is taken once, in float32, as transformers computes it per call)."""

    param: torch.Tensor
    index: tuple[Any, ...] = ()
    add: float = 0.0

    def load(self, tensor: torch.Tensor) -> None:
        target = self.param[self.index] if self.index else self.param
        if target.shape != tensor.shape:
            raise ValueError(f"weight shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.float() + self.add if self.add else tensor)


@dataclass
class Context:
    """What a forward pass hands every layer."""

    ops: TorchOps | TritonOps
    attn: AttentionBackend
    fb: ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None, offset: float = 0.0) -> None:
        """offset: 1.0 for Gemma's (1 + w) norms (added to the checkpoint's w when it loads)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps, self.offset = eps, offset

    def piece(self) -> Piece:
        return Piece(self.weight, add=self.offset)

    def forward(self, x: torch.Tensor, ops: TorchOps | TritonOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False  # on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)


class Attention(nn.Module):
    def __init__(
        self, hidden: int, shape: AttentionShape, layer: int, spec: LayerAttention, eps: float,
        norm_offset: float, dtype: torch.dtype | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.layer, self.spec, self.shape = layer, spec, shape
        d = shape.head_dim
        self.q_size, self.kv_size = shape.num_heads * d, shape.num_kv_heads * d
        rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Parameter(torch.empty(rows, hidden, dtype=dtype))
        self.qkv_bias = nn.Parameter(torch.empty(rows, dtype=dtype)) if shape.bias else None
        self.o_proj = nn.Parameter(torch.empty(hidden, self.q_size, dtype=dtype))
        self.q_norm = self.k_norm = None
        if shape.qk_norm:
            self.q_norm = RMSNorm(d, eps, dtype, norm_offset)
            self.k_norm = RMSNorm(d, eps, dtype, norm_offset)

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        t, s = h.shape[0], self.shape
        q, k, v = F.linear(h, self.qkv_proj, self.qkv_bias).split(
            (self.q_size, self.kv_size, self.kv_size), dim=-1
        )
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, s.head_dim), ctx.ops)
            k = self.k_norm(k.reshape(-1, s.head_dim), ctx.ops)
        q = q.view(t, s.num_heads, s.head_dim)
        k, v = k.view(t, s.num_kv_heads, s.head_dim), v.view(t, s.num_kv_heads, s.head_dim)
        o = ctx.attn.forward(q, k, v, self.layer, ctx.fb, self.spec)  # rotates q and k as it stores
        return F.linear(o.reshape(t, self.q_size), self.o_proj)

    def pieces(self, prefix: str, fused: bool = False) -> dict[str, Piece]:
        """`<prefix>.q_proj.weight` ... as transformers names them; fused: Phi-3's one `qkv_proj`."""
        q, kv = self.q_size, self.kv_size
        parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        if fused:
            out = {f"{prefix}.qkv_proj.weight": Piece(self.qkv_proj)}
        else:
            out = {f"{prefix}.{n}.weight": Piece(self.qkv_proj, (rows,)) for n, rows in parts.items()}
        if self.qkv_bias is not None:
            out |= {f"{prefix}.{n}.bias": Piece(self.qkv_bias, (rows,)) for n, rows in parts.items()}
        out[f"{prefix}.o_proj.weight"] = Piece(self.o_proj)
        if self.q_norm is not None and self.k_norm is not None:
            out[f"{prefix}.q_norm.weight"] = self.q_norm.piece()
            out[f"{prefix}.k_norm.weight"] = self.k_norm.piece()
        return out


ACTIVATIONS = ("silu", "gelu_tanh")


def activation_of(raw: dict[str, Any]) -> str:
    """config.json's hidden_act / hidden_activation -> one of ACTIVATIONS."""
    name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if name not in names:
        raise ValueError(f"unsupported hidden activation {name!r}; supported: {', '.join(names)}")
    return names[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up in one fused weight [gate; up]."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.act, self.intermediate = act, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype))

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        return F.linear(ctx.ops.gate_up_act(h, self.gate_up_proj, self.act), self.down_proj)

    def pieces(self, prefix: str, fused: bool = False) -> dict[str, Piece]:
        """`<prefix>.gate_proj.weight` ...; fused: Phi-3's one `gate_up_proj`."""
        i = self.intermediate
        out = {f"{prefix}.down_proj.weight": Piece(self.down_proj)}
        if fused:
            return out | {f"{prefix}.gate_up_proj.weight": Piece(self.gate_up_proj)}
        return out | {
            f"{prefix}.gate_proj.weight": Piece(self.gate_up_proj, (slice(0, i),)),
            f"{prefix}.up_proj.weight": Piece(self.gate_up_proj, (slice(i, 2 * i),)),
        }
