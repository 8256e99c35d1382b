"""The parts every family's decoder layer is made of: RMSNorm, the attention block (fused q/k/v,
optional bias and per-head q/k norms, the layer's RoPE, window and soft-cap handed to the backend),
the gated MLP (SwiGLU or GeGLU) and the weight pieces each part takes from a checkpoint.

Parameters are made with `torch.empty` in the model's dtype (filled by the loader or `init_dummy`);
fused parameters (q/k/v, gate/up, the experts' stacks) take their checkpoint tensors as slices
(`Piece`), so a family maps names and nothing is concatenated while loading.

Under tensor parallelism (services/scheduler/parallel/) each part is built with its rank's share
(`Shard`): q/k/v and gate/up keep the rank's heads and MLP slice (column-parallel), o and down take the
matching input columns and all-reduce their partial sums (row-parallel); a `Piece` then names the
slice of the checkpoint tensor it reads (`src`), so a rank reads only its part of each tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.attention.base import AttentionBackend, LayerAttention
from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.parallel.group import TensorParallel
from services.scheduler.parallel.shard import SINGLE, Shard

if TYPE_CHECKING:
    from services.scheduler.models.ops import TorchOps, TritonOps


@dataclass
class Piece:
    """Where one checkpoint tensor goes: `param[index]` takes `tensor[src]` (the whole tensor when
    src is empty), plus `add` (Gemma's norms store w for a scale of 1 + w: the sum is taken once, in
    float32, as transformers computes it per call). The tensor may be a safetensors slice, read here
    for src only."""

    param: torch.Tensor
    index: tuple[Any, ...] = ()
    add: float = 0.0
    src: tuple[Any, ...] = ()

    def load(self, source: Any) -> None:
        tensor = source[self.src] if self.src else source[:]
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
    tp: TensorParallel


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
        norm_offset: float, dtype: torch.dtype | None, shard: Shard = SINGLE,
    ) -> None:  # fmt: skip
        """shape: the model's heads; this rank keeps `shard.heads(...)` of them."""
        super().__init__()
        self.layer, self.spec, self.shape = layer, spec, shape
        self.heads = heads = shard.heads(shape.num_heads, shape.num_kv_heads)
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        d = shape.head_dim
        self.q_size, self.kv_size = heads.q_count * d, heads.kv_count * d
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
        q = q.view(t, self.num_heads, s.head_dim)
        k, v = k.view(t, self.num_kv_heads, s.head_dim), v.view(t, self.num_kv_heads, s.head_dim)
        o = ctx.attn.forward(q, k, v, self.layer, ctx.fb, self.spec)  # rotates q and k as it stores
        return ctx.tp.all_reduce(F.linear(o.reshape(t, self.q_size), self.o_proj))

    def pieces(self, prefix: str, fused: bool = False) -> dict[str, Piece | tuple[Piece, ...]]:
        """`<prefix>.q_proj.weight` ... as transformers names them; fused: Phi-3's one `qkv_proj`.
        Each takes this rank's heads' rows (o_proj: their columns)."""
        q, kv, d, h = self.q_size, self.kv_size, self.shape.head_dim, self.heads
        q_all = self.shape.num_heads * d
        kv_all = self.shape.num_kv_heads * d
        q_src = slice(h.q_start * d, h.q_start * d + q)
        k_src = slice(h.kv_start * d, h.kv_start * d + kv)
        parts = {  # name: (rows here, rows of that checkpoint tensor, offset in the fused tensor)
            "q_proj": (slice(0, q), q_src, 0),
            "k_proj": (slice(q, q + kv), k_src, q_all),
            "v_proj": (slice(q + kv, q + 2 * kv), k_src, q_all + kv_all),
        }

        def fused_rows(src: slice, offset: int) -> slice:
            return slice(src.start + offset, src.stop + offset)

        out: dict[str, Piece | tuple[Piece, ...]] = {}
        if fused:
            out[f"{prefix}.qkv_proj.weight"] = tuple(
                Piece(self.qkv_proj, (r,), src=(fused_rows(src, off),)) for r, src, off in parts.values()
            )
        else:
            for n, (r, src, _) in parts.items():
                out[f"{prefix}.{n}.weight"] = Piece(self.qkv_proj, (r,), src=(src,))
        if self.qkv_bias is not None:
            for n, (r, src, _) in parts.items():
                out[f"{prefix}.{n}.bias"] = Piece(self.qkv_bias, (r,), src=(src,))
        out[f"{prefix}.o_proj.weight"] = Piece(self.o_proj, src=(slice(None), q_src))
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

    def __init__(
        self, hidden: int, intermediate: int, act: str, dtype: torch.dtype | None, shard: Shard = SINGLE
    ) -> None:
        """intermediate: the model's width; this rank keeps `shard.slice(intermediate)` of it."""
        super().__init__()
        self.act, self.full = act, intermediate
        self.start, self.intermediate = shard.slice(intermediate)
        i = self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(2 * i, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(hidden, i, dtype=dtype))

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        partial = F.linear(ctx.ops.gate_up_act(h, self.gate_up_proj, self.act), self.down_proj)
        return ctx.tp.all_reduce(partial)

    def pieces(self, prefix: str, fused: bool = False) -> dict[str, Piece | tuple[Piece, ...]]:
        """`<prefix>.gate_proj.weight` ...; fused: Phi-3's one `gate_up_proj` ([gate; up] rows)."""
        i, a = self.intermediate, self.start
        gate, up, mine = (slice(0, i),), (slice(i, 2 * i),), slice(a, a + i)
        out: dict[str, Piece | tuple[Piece, ...]] = {
            f"{prefix}.down_proj.weight": Piece(self.down_proj, src=(slice(None), mine))
        }
        if fused:
            up_src = slice(self.full + a, self.full + a + i)
            out[f"{prefix}.gate_up_proj.weight"] = (
                Piece(self.gate_up_proj, gate, src=(mine,)),
                Piece(self.gate_up_proj, up, src=(up_src,)),
            )
            return out
        out[f"{prefix}.gate_proj.weight"] = Piece(self.gate_up_proj, gate, src=(mine,))
        out[f"{prefix}.up_proj.weight"] = Piece(self.gate_up_proj, up, src=(mine,))
        return out
