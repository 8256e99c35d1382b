"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a linear router, softmax over the experts,
the top k kept (renormalised to sum to 1 where the family says so), and each token's output the
weighted sum of its k experts' gated MLPs.

The experts' weights are stacked, `w_gate_up` [E, 2I, H] and `w_down` [E, H, I], so one kernel
reads them all. Two runners compute the experts (`moe_runner_backend`):
- `torch`: a loop over the experts that have tokens, as transformers runs it (gather, gate/up,
  activation, down, weight, index_add), so fp32 output matches it; the CPU path. Its shapes depend
  on the routing, so it cannot run inside a CUDA graph.
- `triton`: sglbus_kernels/fused_moe.py, a grouped GEMM over the tokens sorted by expert (SGLang's
  design); fixed shapes, captured in CUDA graphs; the default on CUDA.

Under tensor parallelism every rank holds every expert's slice of the intermediate width (as SGLang's
TP MoE does) and the router in full: each computes its partial output for all tokens, all-reduced."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.models.layers import Context, Piece
from services.scheduler.parallel.shard import SINGLE, Shard

# (x, w_gate_up, w_down, topk_weights, topk_ids) -> [T, H]
MoeRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def moe_loop(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """transformers' expert loop, step for step (silu experts); weights [T, k] float32 (the product
    with them is taken in float32, then rounded to x's dtype, as Mixtral's does)."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w_gate_up.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for e in (mask.sum(dim=(-1, -2)) > 0).nonzero()[:, 0].tolist():
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], w_gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w_down[e]) * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def moe_fused(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    from sglbus_kernels.fused_moe import fused_moe

    return fused_moe(x, w_gate_up, w_down, weights, ids)


MOE_RUNNERS: dict[str, MoeRunner] = {"torch": moe_loop, "triton": moe_fused}


class SparseMoE(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
        dtype: torch.dtype | None, shard: Shard = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.start, self.intermediate = shard.slice(intermediate)
        intermediate = self.intermediate
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype))

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        probs = torch.softmax(F.linear(h, self.gate), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = ctx.ops.moe(h, self.w_gate_up, self.w_down, weights, ids)  # float32 weights
        return ctx.tp.all_reduce(out)

    def pieces(self, prefix: str, gate: str, names: tuple[str, str, str]) -> dict[str, Piece]:
        """`<prefix>.<gate>.weight` (the router) and `<prefix>.experts.<e>.<name>.weight` for the
        (gate, up, down) names: Mixtral's (w1, w3, w2), Qwen3-MoE's (gate_proj, up_proj, down_proj);
        each expert's rows (down: columns) of this rank's slice."""
        i, mine = self.intermediate, slice(self.start, self.start + self.intermediate)
        out = {f"{prefix}.{gate}.weight": Piece(self.gate)}
        for e in range(self.num_experts):
            p = f"{prefix}.experts.{e}"
            out[f"{p}.{names[0]}.weight"] = Piece(self.w_gate_up, (e, slice(0, i)), src=(mine,))
            out[f"{p}.{names[1]}.weight"] = Piece(self.w_gate_up, (e, slice(i, 2 * i)), src=(mine,))
            out[f"{p}.{names[2]}.weight"] = Piece(self.w_down, (e,), src=(slice(None), mine))
        return out
