"""Extend attention (prefill, chunked prefill, prefix-cache hits) over the token-level KV pool.

    k_buf, v_buf      [num_slots + 1, Hkv, D]  slot 0 is padding (never handed out; read, never trusted)
    req_to_token      [rows, context_len]      row r: the slot of each token of the request using row r
    q, out            [T, H, D]                request i's new tokens at rows start_i .. start_i + ext_i - 1

Request i has prefix_i cached tokens and ext_i new ones, all already in the pool. Its new token m sits
at position prefix_i + m and attends to keys 0 .. prefix_i + m:

    keys     0 ............ prefix_i-1 | prefix_i ........ prefix_i+ext_i-1
    token m  all visible (the cache)   | causal: up to and including its own position

Grid (B, cdiv(max_extend_len, BLOCK_M), H): one program takes BLOCK_M new tokens of one request for
one q head (q head h reads kv head h // (H / Hkv)); blocks past the request's ext_i do nothing. Keys
stream in BLOCK_N tiles with an online softmax and stop at the block's causal limit. Key 0 is visible
to every row, so each row's running max is finite after the first tile.

A sliding window (a runtime argument; token m sees keys pos - window < p <= pos, pos = prefix_i + m)
also starts the keys at the block's first row's window, rounded down to a tile: no block reads keys
before its rows' windows, and the loop covers about window + BLOCK_M keys however long the sequence.
Later rows of the block may see none of the first tiles, so their running max starts at a finite
floor instead of -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglbus_kernels.dot_operands import dot_operands
from sglbus_kernels.index_args import index_jit
from sglbus_kernels.online_softmax import attend_tile, score_scales

# the windowed kernel's initial running max: below any score, yet exp2(floor - floor) is 1, not NaN
_NO_MAX = tl.constexpr(-1.0e30)


@index_jit("req_pool_indices", "prefix_lens", "extend_lens", "extend_start_loc")
def _extend_kernel(
    q, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
    qk_scale, cap_scale, window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_rr, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    block_m = tl.program_id(1)
    head = tl.program_id(2)

    ext_len = tl.load(extend_lens + req).to(tl.int32)
    if block_m * BLOCK_M < ext_len:
        prefix = tl.load(prefix_lens + req).to(tl.int32)
        tok0 = tl.load(extend_start_loc + req).to(tl.int64)
        row = tl.load(req_pool_indices + req).to(tl.int64)
        kv_head = head // GROUP
        m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < ext_len
        pos = prefix + m
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_tile = tl.load(
            q + (tok0 + m[:, None]) * stride_qt + head * stride_qh + d[None, :] * stride_qd,
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        m_i = tl.full([BLOCK_M], _NO_MAX if WINDOW else float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # the causal limit of the block's last row: keys past it are visible to no row here
        kv_end = prefix + tl.minimum(ext_len, (block_m + 1) * BLOCK_M)
        # the window's start for the block's first row: keys before it are visible to no row here
        kv_first = tl.maximum(prefix + block_m * BLOCK_M - window + 1, 0) if WINDOW else 0
        for n0 in range(kv_first // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            if WINDOW:
                n_ok = n_ok & (n >= kv_first)
            slots = tl.load(req_to_token + row * stride_rr + n * stride_rt, mask=n_ok, other=0)
            kv_mask = n_ok[:, None] & d_ok[None, :]
            visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
            if WINDOW:
                visible = visible & (n[None, :] > pos[:, None] - window)
            m_i, l_i, acc = attend_tile(
                q_tile, k_buf, v_buf, slots, kv_head, d, kv_mask, visible, m_i, l_i, acc, qk_scale,
                cap_scale, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
                DOT_DTYPE, DOT_PRECISION, SOFTCAP,
            )  # fmt: skip
        res = acc / l_i[:, None]
        tl.store(
            out + (tok0 + m[:, None]) * stride_ot + head * stride_oh + d[None, :] * stride_od,
            res.to(out.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )


def _blocks(device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). GPU: the best of BLOCK_M 64/128, BLOCK_N 32/64/128,
    4/8 warps and 2/3 stages on an H200 (head_dim 128, bf16), for 8 x 256 new tokens up to 8192."""
    if device.type == "cpu":  # the interpreter: small tiles, so short test sequences span several
        return 16, 16, 4, 1
    return 128, 64, 4, 3


def extend_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of each request's new tokens over its cached prefix and themselves; writes out.
    Any strides; max_extend_len (a host int) must be >= every extend_lens[i]. out may be q itself
    (each program reads its own rows of q before it writes them).

    window > 0 (sliding window): the token at position i sees keys i - window < p <= i only, its own
    included (as transformers' sliding mask). softcap > 0 (Gemma 2): each score s = sm_scale * q.k
    becomes softcap * tanh(s / softcap) before the softmax."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window {window} and softcap {softcap} must be >= 0 (0: off)")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buf.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} q heads do not group evenly over {num_kv_heads} kv heads")
    batch = req_pool_indices.shape[0]
    if batch == 0 or max_extend_len <= 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps, num_stages = _blocks(q.device)
    dot_dtype, precision = dot_operands(k_buf.dtype, q.device)
    qk_scale, cap_scale = score_scales(sm_scale, softcap)
    _extend_kernel[(batch, triton.cdiv(max_extend_len, block_m), num_heads)](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
        qk_scale, cap_scale, window,
        *q.stride(), *out.stride(), *k_buf.stride(), *v_buf.stride(), *req_to_token.stride(),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, WINDOW=window > 0, SOFTCAP=softcap > 0,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
