"""One key tile of flash attention, shared by the decode and extend kernels (inlined by Triton):
load the tile's K and V through their pool slots, score the query tile, and fold the tile into the
running max / sum / accumulator of the online softmax (base 2: qk_scale includes log2 e).

    visible [M, N]   which (query, key) pairs count (in range, causal); the rest score -inf
    kv_mask [N, D]   which K/V elements to load; masked rows load as zeros, so garbage (even NaN) in
                     unread slots never reaches the accumulator
Every query row must see at least one key of the tile, so the running max stays finite.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q_tile, k_buf, v_buf, slots, kv_head, d, kv_mask, visible, m_i, l_i, acc, qk_scale,
    stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    k = tl.load(
        k_buf + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    qk = tl.dot(q_tile, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    v = tl.load(
        v_buf + slots[:, None] * stride_vs + kv_head * stride_vh + d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv
