"""RMSNorm and fused residual-add + RMSNorm in Triton: one program per token row.

Numerics follow models/llama.py's RMSNorm (as transformers computes it): the residual sum is rounded
to the input dtype, the normalisation runs in fp32, the result is cast back to the input dtype and
only then multiplied by the weight, in the promoted dtype of the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    x_stride,
    res_stride,
    out_stride,
    n_cols,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # arithmetic in fp32, rounded where torch rounds (Triton's interpreter also mis-adds bf16 directly)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    if ADD_RESIDUAL:
        res = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x32 + res.to(tl.float32)).to(dtype)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
        x32 = x.to(tl.float32)
    y = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with a contiguous last dim"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = triton.next_power_of_2(x.shape[1])
    res = x if residual is None else residual  # a placeholder pointer when there is no residual
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), x.shape[1], eps,
        ADD_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 1024, 4), 16),
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, H]: weight * (x / rms(x)).to(x.dtype)."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, rounded to the dtype); returns (rms_norm(residual), residual)."""
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    return _launch(x, residual, weight, eps), residual
