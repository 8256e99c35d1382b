"""Rotate-half RoPE in Triton, fused with the KV store: `rope_store_kv` rotates q in place, writes k
rotated straight into its KV-pool slot and copies v to its slot, one program per token for all its heads
(the triton attention backend's store: k read once and not written back, since the attention kernels
read keys from the pool).

q, k and v may be strided views of the fused qkv projection; of them only q's own elements are written.
The cos/sin tables are [max_pos, D] fp32 with equal halves (`cat((freqs, freqs), -1)`), so only the
first half of a row is read. The rotation runs in fp32 and is rounded once to the input dtype, where
services/scheduler/rotary.py's torch reference rounds cos/sin and each product to the dtype first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglbus_kernels.index_args import index_jit
from sglbus_kernels.kv_store import _copy_heads


@triton.jit
def _rotate(
    ptr, head_stride, dst, dst_head_stride, n_heads, cos, sin, d, d_mask,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """x[:HALF], x[HALF:] -> x1*cos - x2*sin, x2*cos + x1*sin for every head of one token, written
    to dst (which may be ptr) in dst's dtype."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < n_heads)[:, None] & d_mask[None, :]
    lo = ptr + h[:, None] * head_stride + d[None, :]
    out = dst + h[:, None] * dst_head_stride + d[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    ty = dst.dtype.element_ty
    tl.store(out, (a * cos - b * sin).to(x1.dtype).to(ty), mask=mask)
    tl.store(out + HALF, (b * cos + a * sin).to(x1.dtype).to(ty), mask=mask)


@index_jit("pos_ptr", "loc_ptr")
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, k_buf, v_buf, loc_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    kb_stride_s, kb_stride_h, vb_stride_s, vb_stride_h, table_stride, n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * table_stride + d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * table_stride + d, mask=d_mask, other=0.0)[None, :]
    q = q_ptr + t * q_stride_t
    _rotate(q, q_stride_h, q, q_stride_h, n_q_heads, cos, sin, d, d_mask, HALF, BLOCK_HQ)
    k_dst = k_buf + slot * kb_stride_s
    _rotate(
        k_ptr + t * k_stride_t, k_stride_h, k_dst, kb_stride_h, n_k_heads, cos, sin, d, d_mask, HALF, BLOCK_HK
    )
    v_dst = v_buf + slot * vb_stride_s
    _copy_heads(v_ptr + t * v_stride_t, v_stride_h, v_dst, vb_stride_h, n_k_heads, DIM, BLOCK_HK, BLOCK_DIM)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """q [T, H, D] rotated in place; k_buf[loc] = rotated k, v_buf[loc] = v (buffers [S, Hkv, D]).
    k itself is left as it was."""
    t, n_q, dim = q.shape
    n_k = k.shape[1]
    assert k.shape == (t, n_k, dim) and v.shape == k.shape and k.dtype == q.dtype and dim % 2 == 0
    assert k_buf.shape[1:] == k.shape[1:] and v_buf.shape[1:] == k.shape[1:] and loc.shape == (t,)
    assert all(x.stride(-1) == 1 for x in (q, k, v, k_buf, v_buf)), "head_dim must be contiguous"
    assert cos.shape == sin.shape and cos.shape[1] == dim and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1 and positions.shape == (t,)
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    _rope_store_kernel[(t,)](
        q, k, v, cos, sin, positions, k_buf, v_buf, loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), cos.stride(0), n_q, n_k,
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        DIM=dim, BLOCK_DIM=triton.next_power_of_2(dim),
        num_warps=min(max(block_hq * block_d // 512, 1), 8),
    )  # fmt: skip
