"""Decode attention (one query token per request) over the token-level KV pool: flash-decoding.

    k_buf, v_buf      [num_slots + 1, Hkv, D]  slot 0 is padding (never handed out; read, never trusted)
    req_to_token      [rows, context_len]      row r: the slot of each token of the request using row r
    q, out            [B, H, D]                one token per request; q head h reads kv head h // (H / Hkv)
    scratch           (o [max_batch, H, S, D], lse [max_batch, H, S]) float32, from decode_scratch

Stage 1, grid (Hkv, B, S): request b's keys 0..seq_len-1 are cut into S chunks of
`chunk = cdiv(cdiv(seq_len, S), BLOCK_N) * BLOCK_N` keys; split s covers [s * chunk, (s + 1) * chunk).
S is scratch's split count at small batches and shrinks as B * Hkv alone fills the GPU (about four
programs per SM): more splits then only add partial-result traffic (on an H200, one split at batch 64
and seq_len 512 is 15% faster than 16). S depends on B only, so a captured graph keeps its own.
One program takes every q head of one kv head (the GQA group, padded to BLOCK_H >= 16 rows so tl.dot
gets a legal tile), so each K/V tile is loaded once per group. It writes the split's normalised
partial output and its log-sum-exp (base 2). Splits that start at or past seq_len write nothing.

Stage 2, grid (B, H): combines the non-empty splits of one head, recomputing which are non-empty from
seq_len, so scratch rows never written are never read. A request with seq_len 0 gets zeros.

With one split (large batches: B * Hkv alone fills the GPU) and no cascade, stage 1 writes the output
itself and stage 2 does not run: the partials' float32 round trip through scratch and the second
launch cost ~0.9 ms a step at ~2,400 requests on an H200 (32 layers), for a combine that only copies.

The grid depends only on B, H and S: no host synchronisation, safe to capture in a CUDA graph.

Cascade (a CascadePlan, cascade_attention.py): a grouped request's splits cover only its own keys,
kv_starts[b] .. seq_len-1; the shared prefix's partial lands in the scratch's last slot
(shared_prefix_attention, between the two stages), and stage 2 folds it in where kv_starts[b] > 0.

Sliding window: the splits cover only keys max(0, seq_len - window) .. seq_len-1, computed in both
stages from seq_len (a runtime argument: one compiled variant, graph-safe), so keys before the window
are never read. A shared prefix may reach outside the window, so a window excludes the cascade.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from sglbus_kernels.cascade_attention import shared_prefix_attention
from sglbus_kernels.cascade_plan import CascadePlan
from sglbus_kernels.dot_operands import dot_operands
from sglbus_kernels.index_args import index_jit
from sglbus_kernels.online_softmax import attend_keys, score_scales

# S, the number of key splits per request: enough programs to fill an H200's 132 SMs at batch 1-32
DEFAULT_KV_SPLITS = 16
# stage 1 on a GPU, (keys per tile, warps, pipeline stages), by whether it writes the output directly
# (one split: large batches) or partials. One split: 2 warps, 2 stages made the seed workload's decode
# steps 1.6-1.9% shorter on an H200 than 4 warps, 3 stages (docs/benchmarks.md, seventeenth session).
# The interpreter takes 16-key tiles, so short test sequences span several.
GPU_LAUNCH = {True: (64, 2, 2), False: (64, 4, 3)}


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(max_splits: int, batch: int, num_kv_heads: int, device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: every split, so tests cover them
        return max_splits
    fill = min(max_splits, max(1, 4 * _sm_count(device.index) // (batch * num_kv_heads)))
    return 1 << (fill.bit_length() - 1)  # a power of two: few variants to compile (each at first use)


@triton.jit
def _key_range(seq_lens, kv_starts, b, window, USE_START: tl.constexpr, WINDOW: tl.constexpr):
    """Request b's keys kv0 .. seq_len-1 that its splits cover: after its shared prefix (cascade) or
    within its window; both stages derive the splits from this."""
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    kv0 = 0
    if USE_START:
        kv0 = tl.load(kv_starts + b).to(tl.int32)
    if WINDOW:
        kv0 = tl.maximum(seq_len - window, 0)
    return seq_len, kv0


@index_jit("req_pool_indices", "seq_lens", "kv_starts")
def _decode_split_kernel(
    q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, kv_starts, part_o, part_lse, out,
    qk_scale, cap_scale, window,
    stride_qb, stride_qh, stride_qd,
    stride_ob, stride_oh, stride_od,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_rr, stride_rt,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_START: tl.constexpr, DIRECT: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)  # the kv heads of one request in adjacent programs (see the grid)
    b = tl.program_id(1)
    split = tl.program_id(2)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # DIRECT (one split, no cascade): the output itself, else the split's partial and lse
    out_ptr = out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od

    seq_len, kv0 = _key_range(seq_lens, kv_starts, b, window, USE_START, WINDOW)
    chunk = tl.cdiv(tl.cdiv(seq_len - kv0, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv0 + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if start < end:
        row = tl.load(req_pool_indices + b).to(tl.int64)
        q_tile = tl.load(
            q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=head_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        o, lse = attend_keys(
            q_tile, k_buf, v_buf, req_to_token, row, start, end, kv_head, d, d_ok, qk_scale, cap_scale,
            stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_rr, stride_rt,
            BLOCK_H, BLOCK_D, BLOCK_N, DOT_DTYPE, DOT_PRECISION, SOFTCAP,
        )  # fmt: skip
        if DIRECT:
            tl.store(out_ptr, o.to(out.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
        else:
            o_ptr = part_o + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
            tl.store(o_ptr + d[None, :] * stride_pd, o, mask=head_ok[:, None] & d_ok[None, :])
            lse_ptr = part_lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls
            tl.store(lse_ptr, lse, mask=head_ok)
    elif DIRECT:  # no keys (seq_len 0): zeros, as the combine writes
        zeros = tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(out.dtype.element_ty)
        tl.store(out_ptr, zeros, mask=head_ok[:, None] & d_ok[None, :])


@index_jit("seq_lens", "kv_starts")
def _decode_combine_kernel(
    out, seq_lens, kv_starts, part_o, part_lse, window,
    stride_ob, stride_oh, stride_od,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_START: tl.constexpr, PREFIX_SLOT: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    head = tl.program_id(1)

    seq_len, kv0 = _key_range(seq_lens, kv_starts, b, window, USE_START, WINDOW)
    chunk = tl.cdiv(tl.cdiv(seq_len - kv0, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s = tl.arange(0, BLOCK_S)
    s_ok = (s < NUM_SPLITS) & (s * chunk < seq_len - kv0)
    if USE_START:  # the shared prefix's partial (cascade_attention.py), when the request has one
        s_ok = s_ok | ((s == PREFIX_SLOT) & (kv0 > 0))
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_ptr = part_lse + b.to(tl.int64) * stride_lb + head * stride_lh + s * stride_ls
    lse = tl.load(lse_ptr, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_ok, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    o_ptr = part_o + b.to(tl.int64) * stride_pb + head * stride_ph
    o = tl.load(
        o_ptr + s[:, None] * stride_ps + d[None, :] * stride_pd, mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_ptr = out + b.to(tl.int64) * stride_ob + head * stride_oh + d * stride_od
    tl.store(out_ptr, res.to(out.dtype.element_ty), mask=d_ok)


def decode_scratch(
    max_batch: int, num_heads: int, head_dim: int, num_kv_splits: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Preallocated float32 buffers for the split-K partials: o [max_batch, H, S + 1, D] and the base-2
    log-sum-exp [max_batch, H, S + 1], S = num_kv_splits the most splits a request's keys get (pass
    DEFAULT_KV_SPLITS); the last slot holds a shared prefix's partial (cascade). Allocated once; a CUDA
    graph replays over the same buffers."""
    shape = (max_batch, num_heads, num_kv_splits + 1)
    o = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
    lse = torch.empty(shape, dtype=torch.float32, device=device)
    return o, lse


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
    sm_scale: float,
    cascade: CascadePlan | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """One query token per request: out[b] = softmax(q[b] K^T * sm_scale) V over keys 0..seq_lens[b]-1
    of row req_pool_indices[b]. Any strides; out may be q itself (stage 1 reads q before stage 2 writes).
    With a cascade plan, each grouped request's splits start at its shared prefix's end and the prefix
    is attended once per tile of its group (cascade_attention.py); the combine merges both.

    window > 0 (sliding window): only keys seq_len - window .. seq_len-1, the query's own included (as
    transformers' sliding mask); not with a cascade (ValueError), whose prefix may lie outside it.
    softcap > 0 (Gemma 2): each score s = sm_scale * q.k becomes softcap * tanh(s / softcap); with a
    cascade too."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window {window} and softcap {softcap} must be >= 0 (0: off)")
    if window and cascade is not None:
        raise ValueError("a sliding window excludes the cascade: its shared prefix may lie outside it")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    part_o, part_lse = scratch
    if batch > part_o.shape[0] or part_o.shape[1] != num_heads or part_o.shape[3] != head_dim:
        raise ValueError(f"scratch {tuple(part_o.shape)} does not fit q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} q heads do not group evenly over {num_kv_heads} kv heads")
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    prefix_slot = part_o.shape[2] - 1
    num_splits = _num_splits(prefix_slot, batch, num_kv_heads, q.device)
    direct = num_splits == 1 and cascade is None
    block_n, warps, stages = (16, 4, 3) if q.device.type == "cpu" else GPU_LAUNCH[direct]
    dot_dtype, precision = dot_operands(k_buf.dtype, q.device)
    starts = seq_lens if cascade is None else cascade.kv_starts  # (unread without a cascade)
    qk_scale, cap_scale = score_scales(sm_scale, softcap)
    # kv heads first: a request's heads run side by side and read each slot's K (V) row together
    # (contiguous in the pool), 1-3.5% faster on an H200 than requests first
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, starts, part_o, part_lse, out,
        qk_scale, cap_scale, window,
        *q.stride(), *out.stride(), *k_buf.stride(), *v_buf.stride(), *req_to_token.stride(),
        *part_o.stride(), *part_lse.stride(),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, USE_START=cascade is not None, DIRECT=direct,
        WINDOW=window > 0, SOFTCAP=softcap > 0, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if direct:
        return
    if cascade is not None:
        shared_prefix_attention(
            q, k_buf, v_buf, req_to_token, cascade, part_o, part_lse, prefix_slot, sm_scale, softcap
        )
    slots = num_splits if cascade is None else prefix_slot + 1
    _decode_combine_kernel[(batch, num_heads)](
        out, seq_lens, starts, part_o, part_lse, window, *out.stride(), *part_o.stride(), *part_lse.stride(),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(slots),
        BLOCK_D=block_d, BLOCK_N=block_n, USE_START=cascade is not None, PREFIX_SLOT=prefix_slot,
        WINDOW=window > 0, num_warps=4 if block_d >= 128 else 2,
    )  # fmt: skip
