"""One key tile of flash attention, shared by the decode and extend kernels (inlined by Triton):
load the tile's K and V through their pool slots, score the query tile, and fold the tile into the
running max / sum / accumulator of the online softmax (base 2: qk_scale includes log2 e).

    visible [M, N]   which (query, key) pairs count (in range, causal, in the window); the rest -inf
    kv_mask [N, D]   which K/V elements to load; masked rows load as zeros, so garbage (even NaN) in
                     unread slots never reaches the accumulator
A query row that has seen no key yet must see one in the tile, or its running max must start finite
(exp2(-inf - -inf) is NaN): the windowed extend kernel starts it at a finite floor.

SOFTCAP (Gemma 2's logit soft-capping): the natural-scale score s = sm_scale * q.k becomes
cap * tanh(s / cap) before the softmax. `score_scales` folds the constants so a tile costs one
multiply, exp2 and divide more: tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends (exp2 overflowing
to inf gives 1, underflowing to 0 gives -1), and built from exp2 because the interpreter has no tanh.

`attend_keys` runs the tiles over a whole key range with no mask beyond it (the decode and
shared-prefix kernels) and returns the normalised partial output and its log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def score_scales(sm_scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' (qk_scale, cap_scale): without a cap, q.k * qk_scale is the base-2 score (cap_scale
    unused); with one, exp2(q.k * qk_scale) is exp(2 s / cap) and cap_scale * tanh(s / cap) the base-2
    capped score."""
    if softcap <= 0:
        return sm_scale * LOG2E, 0.0
    return 2.0 * sm_scale * LOG2E / softcap, softcap * LOG2E


@triton.jit
def attend_tile(
    q_tile, k_buf, v_buf, slots, kv_head, d, kv_mask, visible, m_i, l_i, acc, qk_scale, cap_scale,
    stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    k = tl.load(
        k_buf + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    qk = tl.dot(q_tile, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:  # qk is 2 s / cap here (score_scales)
        qk = cap_scale * (1.0 - 2.0 / (tl.exp2(qk) + 1.0))
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


@triton.jit
def attend_keys(
    q_tile, k_buf, v_buf, req_to_token, row, start, end, kv_head, d, d_ok, qk_scale, cap_scale,
    stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_rr, stride_rt,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Every query row of the tile over keys start .. end-1 of req_to_token row `row` (no mask beyond
    the range; start < end): the normalised output [ROWS, BLOCK_D] and the log-sum-exp (base 2)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        slots = tl.load(req_to_token + row * stride_rr + n * stride_rt, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        m_i, l_i, acc = attend_tile(
            q_tile, k_buf, v_buf, slots, kv_head, d, kv_mask, n_ok[None, :], m_i, l_i, acc, qk_scale,
            cap_scale, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
            DOT_DTYPE, DOT_PRECISION, SOFTCAP,
        )  # fmt: skip
    return acc / l_i[:, None], m_i + tl.log2(l_i)
