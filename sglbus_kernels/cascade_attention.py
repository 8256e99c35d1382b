"""Shared-prefix (cascade) decode attention: many running requests over one long cached prefix (a
system prompt, few-shot examples, the samples of n > 1, a fork) read that prefix's KV once per tile
of requests instead of once per request.

A group's members hold the same KV slots for their first `prefix_len` tokens (the radix cache hands
every request the cached prefix's slots). The plan cuts each group into tiles of at most BLOCK_R
members; one program takes one tile and one kv head, stacks the tile's queries of that kv head's q
heads (BLOCK_R x GROUP rows, one tensor-core tile) and streams the prefix's keys once, with the same
online softmax as the other kernels (online_softmax.attend_tile). It writes each member's partial
output and log-sum-exp (base 2) into the decode scratch's last split slot; the decode kernel covers
each member's own keys from prefix_len on (its `kv_starts`), and the decode combine merges the two.

    members     [M]  batch indices of the grouped requests, tile by tile
    tile_first  [T]  each tile's first entry in members; tile_count [T] its size (<= BLOCK_R)
    tile_len    [T]  the tile's shared prefix length;   tile_row [T] a req_to_token row holding it
    kv_starts   [B]  per request: its shared prefix length (0: not grouped)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglbus_kernels.cascade_plan import CascadePlan
from sglbus_kernels.dot_operands import dot_operands
from sglbus_kernels.index_args import index_jit
from sglbus_kernels.online_softmax import attend_keys, score_scales


@index_jit("members", "tile_first", "tile_count", "tile_len", "tile_row")
def _shared_prefix_kernel(
    q, k_buf, v_buf, req_to_token, members, tile_first, tile_count, tile_len, tile_row,
    part_o, part_lse, qk_scale, cap_scale,
    stride_qb, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_rr, stride_rt,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    PREFIX_SLOT: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    first = tl.load(tile_first + tile).to(tl.int32)
    count = tl.load(tile_count + tile).to(tl.int32)
    prefix = tl.load(tile_len + tile).to(tl.int32)
    row = tl.load(tile_row + tile).to(tl.int64)
    r = tl.arange(0, BLOCK_R * GROUP_P)
    j = r // GROUP_P  # the member of the tile
    g = r % GROUP_P  # the q head within the kv head's group
    ok = (j < count) & (g < GROUP)
    b = tl.load(members + first + j, mask=j < count, other=0).to(tl.int64)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_tile = tl.load(
        q + b[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    o, lse = attend_keys(
        q_tile, k_buf, v_buf, req_to_token, row, 0, prefix, kv_head, d, d_ok, qk_scale, cap_scale,
        stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_rr, stride_rt,
        BLOCK_R * GROUP_P, BLOCK_D, BLOCK_N, DOT_DTYPE, DOT_PRECISION, SOFTCAP,
    )  # fmt: skip
    o_ptr = part_o + b[:, None] * stride_pb + heads[:, None] * stride_ph + PREFIX_SLOT * stride_ps
    tl.store(o_ptr + d[None, :] * stride_pd, o, mask=ok[:, None] & d_ok[None, :])
    lse_ptr = part_lse + b * stride_lb + heads * stride_lh + PREFIX_SLOT * stride_ls
    tl.store(lse_ptr, lse, mask=ok)


def shared_prefix_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    plan: CascadePlan,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    prefix_slot: int,
    sm_scale: float,
    softcap: float = 0.0,
) -> None:
    """Each grouped request's attention over its shared prefix, into split slot `prefix_slot` of the
    decode scratch (decode_attention calls this between its two stages); softcap as decode_attention's."""
    if plan.num_tiles == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    rows = plan.block_r * group_p
    if rows < 16:  # tl.dot needs 16 rows at least
        raise ValueError(f"a tile of {plan.block_r} members x {group_p} heads is under 16 query rows")
    block_n = 16 if q.device.type == "cpu" else 64
    dot_dtype, precision = dot_operands(k_buf.dtype, q.device)
    qk_scale, cap_scale = score_scales(sm_scale, softcap)
    _shared_prefix_kernel[(plan.num_tiles, num_kv_heads)](
        q, k_buf, v_buf, req_to_token, plan.members, plan.tile_first, plan.tile_count, plan.tile_len,
        plan.tile_row, part_o, part_lse, qk_scale, cap_scale,
        *q.stride(), *k_buf.stride(), *v_buf.stride(), *req_to_token.stride(),
        *part_o.stride(), *part_lse.stride(),
        PREFIX_SLOT=prefix_slot, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim,
        BLOCK_R=plan.block_r, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, SOFTCAP=softcap > 0, num_warps=4, num_stages=2,
    )  # fmt: skip
