"""Write one step's keys and values into the KV pool in Triton: one program per token copies all its
heads of k and v to their slot, so `k_buf[loc] = k; v_buf[loc] = v` is one launch instead of two
index_put calls. k and v may be strided views of the fused qkv projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglbus_kernels.index_args import index_jit


@triton.jit
def _copy_heads(
    src,
    src_stride_h,
    dst,
    dst_stride_h,
    n_heads,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < DIM)
    x = tl.load(src + h * src_stride_h + d, mask=mask)
    tl.store(dst + h * dst_stride_h + d, x.to(dst.dtype.element_ty), mask=mask)


@index_jit("loc_ptr")
def _store_kv_kernel(
    k_buf,
    v_buf,
    loc_ptr,
    k_ptr,
    v_ptr,
    kb_stride_s,
    kb_stride_h,
    vb_stride_s,
    vb_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    n_heads,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    _copy_heads(
        k_ptr + t * k_stride_t,
        k_stride_h,
        k_buf + slot * kb_stride_s,
        kb_stride_h,
        n_heads,
        DIM,
        BLOCK_H,
        BLOCK_D,
    )
    _copy_heads(
        v_ptr + t * v_stride_t,
        v_stride_h,
        v_buf + slot * vb_stride_s,
        vb_stride_h,
        n_heads,
        DIM,
        BLOCK_H,
        BLOCK_D,
    )


def store_kv(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buf[loc] = k and v_buf[loc] = v; buffers [S, Hkv, D], loc [T] slots, k and v [T, Hkv, D]."""
    t, n_heads, dim = k.shape
    assert v.shape == k.shape and loc.shape == (t,)
    assert k_buf.shape[1:] == k.shape[1:] and v_buf.shape[1:] == k.shape[1:]
    assert all(x.stride(-1) == 1 for x in (k_buf, v_buf, k, v)), "head_dim must be contiguous"
    block_h, block_d = triton.next_power_of_2(n_heads), triton.next_power_of_2(dim)
    _store_kv_kernel[(t,)](
        k_buf, v_buf, loc, k, v, k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), n_heads,
        DIM=dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=min(max(block_h * block_d // 512, 1), 4),
    )  # fmt: skip
