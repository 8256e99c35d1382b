"""SwiGLU's activation in Triton: silu(gate) * up from the fused gate_up projection, in one pass.

A 2-D grid of (token row, column block); the product is computed in fp32 and rounded once to the
input dtype (torch rounds silu(gate) and the product separately, so bf16 results can differ by 1 ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu as torch writes it: x / (1 + exp(-x))
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, up second) -> silu(gate) * up [T, I] in gate_up's dtype."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(-1) == 1
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(_BLOCK, triton.next_power_of_2(n))
    grid = (t, triton.cdiv(n, block))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out
