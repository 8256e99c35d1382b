"""The elementwise and normalisation steps of a decoder layer, in two implementations with one
interface: `TorchOps` (the reference; transformers' numerics, so fp32 greedy output matches HF token
for token) and `TritonOps` (sglbus_kernels/: one fused launch per step instead of several torch ops).

    add_rms_norm(x, residual, w, eps)   (rms_norm(x + residual), x + residual)
    gate_up_act(h, w, act)              act(h Wg^T) * (h Wu^T) for the fused weight w = [Wg; Wu],
                                        act silu (SwiGLU) or gelu_tanh (GeGLU: Gemma)
    moe(x, w_gate_up, w_down, weights, ids)   the experts of a sparse MoE layer (models/moe.py)

(RoPE is the attention backend's, fused with the KV store on triton: services/scheduler/rotary.py.)

The Triton versions follow the same rounding (the sum is rounded to the input dtype before it is
normalised; normalisation in fp32; the weight multiplies in the input dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.scheduler.models.moe import MOE_RUNNERS, MoeRunner

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class TorchOps:
    name = "torch"

    def __init__(self, moe: MoeRunner = MOE_RUNNERS["torch"]) -> None:
        self.moe = moe

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @classmethod
    def add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
    def gate_up_act(h: torch.Tensor, weight: torch.Tensor, act: str = "silu") -> torch.Tensor:
        # one product per half, as transformers computes them: contiguous outputs (silu and mul on
        # the strided halves of one fused product cost 2x on CPU) and the same rounding
        gate_w, up_w = weight.chunk(2, dim=0)
        return _ACT[act](F.linear(h, gate_w)) * F.linear(h, up_w)


class TritonOps:
    name = "triton"

    def __init__(self, moe: MoeRunner = MOE_RUNNERS["triton"]) -> None:
        from sglbus_kernels.activation import silu_and_mul
        from sglbus_kernels.norm import fused_add_rms_norm, rms_norm

        self._rms_norm, self._add_rms_norm = rms_norm, fused_add_rms_norm
        self._silu_and_mul = silu_and_mul
        self.moe = moe

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rms_norm(x, residual, weight, eps)  # residual updated in place

    def gate_up_act(self, h: torch.Tensor, weight: torch.Tensor, act: str = "silu") -> torch.Tensor:
        gate_up = F.linear(h, weight)  # one product
        if act == "silu":
            return self._silu_and_mul(gate_up)  # one fused kernel
        gate, up = gate_up.chunk(2, dim=-1)
        return _ACT[act](gate) * up


def make_ops(name: str, moe_runner: str = "auto") -> TorchOps | TritonOps:
    """The ops of attention backend `name`; a sparse MoE layer's experts run on `moe_runner` (auto:
    the fused Triton kernel with the triton backend, the torch loop with the torch one)."""
    if moe_runner != "auto" and moe_runner not in MOE_RUNNERS:
        raise ValueError(f"moe_runner_backend must be auto, {', '.join(MOE_RUNNERS)}, not {moe_runner!r}")
    if name == "triton":
        return TritonOps(MOE_RUNNERS["triton" if moe_runner == "auto" else moe_runner])
    return TorchOps(MOE_RUNNERS["torch" if moe_runner == "auto" else moe_runner])
