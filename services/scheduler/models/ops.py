"""The elementwise and normalisation steps of a decoder layer, in two implementations with one
interface: `TorchOps` (the reference; transformers' numerics, so fp32 greedy output matches HF token
for token) and `TritonOps` (sglbus_kernels/: one fused launch per step instead of several torch ops).

    add_rms_norm(x, residual, w, eps)   (rms_norm(x + residual), x + residual)
    gate_up_silu(h, w)                  silu(h Wg^T) * (h Wu^T) for the fused weight w = [Wg; Wu]

(RoPE is the attention backend's, fused with the KV store on triton: services/scheduler/rotary.py.)

The Triton versions follow the same rounding (the sum is rounded to the input dtype before it is
normalised; normalisation in fp32; the weight multiplies in the input dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    name = "torch"

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
    def gate_up_silu(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # one product per half, as transformers computes them: contiguous outputs (silu and mul on
        # the strided halves of one fused product cost 2x on CPU) and the same rounding
        gate_w, up_w = weight.chunk(2, dim=0)
        return F.silu(F.linear(h, gate_w)) * F.linear(h, up_w)


class TritonOps:
    name = "triton"

    def __init__(self) -> None:
        from sglbus_kernels.activation import silu_and_mul
        from sglbus_kernels.norm import fused_add_rms_norm, rms_norm

        self._rms_norm, self._add_rms_norm = rms_norm, fused_add_rms_norm
        self._silu_and_mul = silu_and_mul

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rms_norm(x, residual, weight, eps)  # residual updated in place

    def gate_up_silu(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(F.linear(h, weight))  # one product, one fused kernel


def make_ops(name: str) -> TorchOps | TritonOps:
    return TritonOps() if name == "triton" else TorchOps()
