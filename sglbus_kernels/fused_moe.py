"""Fused mixture-of-experts: the SwiGLU experts of every routed (token, slot) pair as two grouped GEMMs
over the pairs sorted by expert (SGLang's fused_moe, written our own way).

    topk_ids [T, K]  --align-->  sorted_ids [max_blocks * BLOCK_M]   pair p = t * K + k, pad = T * K
                                 block_expert [max_blocks]           the expert of each BLOCK_M rows
                                 num_padded [1]                      rows in use (a device value)

    expert 0: p p p p . .  | expert 2: p p .  . . .  | (expert 1 has no pairs: no block) | unused ...
              '-- BLOCK_M --'          '-- BLOCK_M --'

    GEMM 1   gate_up[p] = x[p // K] @ w_gate_up[e]^T            [T*K, 2I]
             act = silu(gate) * up                              [T*K, I]   (activation.silu_and_mul)
    GEMM 2   y[p] = topk_weights[p] * (act[p] @ w_down[e]^T)    [T*K, H]
             out[t] = sum_k y[t * K + k]                        [T, H]

Every launch's grid depends only on (T, K, E) and the tiles, never on the routing, and nothing reads a
device value on the host, so the whole layer is CUDA-graph capturable: max_blocks is the most blocks
any routing can need (min(E, T*K) experts in use, each with at most one partial block) and GEMM
programs whose block lies past num_padded return at once.

Rounding: gate_up, act and y are rounded to x's dtype (each from fp32 math); the K-sum adds in fp32
(torch's sum of bf16) and rounds once. `moe_reference` is the per-expert torch loop the kernels replace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglbus_kernels.activation import silu_and_mul
from sglbus_kernels.dot_operands import dot_operands

_ALIGN_BLOCK = 256  # pairs per program of the rank and scatter kernels
_CHUNK_TOKENS = 8192  # longer inputs run in chunks: bounds the [T*K, 2I] intermediate (Mixtral: 940 MB)


@dataclass(frozen=True)
class MoEConfig:
    """The GEMM tiles; block_m also sets the alignment of each expert's segment of sorted rows."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def moe_config(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> MoEConfig:
    """Tiles by the mean rows per expert (T*K/E): a decode step gives each expert a row or two, so
    BLOCK_M 16 wastes least padding and narrow BLOCK_N spreads the weight reads over more programs;
    prefill fills 128-row tiles. Starting points from SGLang's H200 tables (E=8 and E=128 bf16);
    `python -m benchmarks.moe_kernel --sweep` measures the alternatives."""
    if device.type == "cpu":  # the interpreter: tiny tiles, so small test shapes span several blocks
        return MoEConfig(16, 16, 16, 2, 4, 1)
    rows = num_tokens * top_k / num_experts
    if rows < 12:
        return MoEConfig(16, 64, 128, 1, 4, 4)
    if rows < 48:
        return MoEConfig(32, 128, 128, 1, 4, 3)
    if rows < 160:
        return MoEConfig(64, 128, 64, 8, 4, 3)
    return MoEConfig(128, 128, 64, 8, 8, 3)


class MoEAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [max_blocks * block_m] int32: pair index, or T*K on padding rows
    block_expert: torch.Tensor  # [max_blocks] int32: the expert of each block (any valid id past the end)
    num_padded: torch.Tensor  # [1] int32: rows in use, a multiple of block_m


@triton.jit(do_not_specialize=["num_pairs"])
def _rank_kernel(topk_ids, counts, ranks, num_pairs, BLOCK: tl.constexpr):
    """counts[e] += 1 per pair; the old value is the pair's rank among its expert's pairs. The order
    within an expert is the atomics' (not reproducible), which changes no result: each GEMM row
    depends only on its own pair."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < num_pairs
    expert = tl.load(topk_ids + p, mask=ok, other=0).to(tl.int32)
    rank = tl.atomic_add(counts + expert, 1, mask=ok)
    tl.store(ranks + p, rank, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _plan_kernel(
    counts, starts, block_expert, num_padded, sorted_ids, num_experts, num_pairs, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One program: each expert's segment start (counts padded to BLOCK_M, prefix-summed), the expert
    of every block, the rows in use, and every row of sorted_ids set to the padding sentinel."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    padded = tl.cdiv(tl.load(counts + e, mask=e_ok, other=0), BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts + e, ends - padded, mask=e_ok)
    tl.store(num_padded, tl.sum(padded, 0))
    for b0 in range(0, max_blocks, BLOCK_B):  # BLOCK_B x BLOCK_E comparisons a step
        b = b0 + tl.arange(0, BLOCK_B)
        # the block's expert: how many segments end at or before its first row (empty ones included)
        owner = tl.sum((ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(block_expert + b, tl.minimum(owner, num_experts - 1), mask=b < max_blocks)
    pad = tl.full([BLOCK_R], 0, tl.int32) + num_pairs
    for r0 in range(0, max_blocks * BLOCK_M, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(sorted_ids + r, pad, mask=r < max_blocks * BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(topk_ids, ranks, starts, sorted_ids, num_pairs, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < num_pairs
    expert = tl.load(topk_ids + p, mask=ok, other=0).to(tl.int32)
    row = tl.load(starts + expert, mask=ok, other=0) + tl.load(ranks + p, mask=ok, other=0)
    tl.store(sorted_ids + row, p, mask=ok)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks any routing of num_pairs pairs over num_experts experts needs: m experts
    in use take m + sum((c_e - 1) // BLOCK_M) <= m + (T*K - m) // BLOCK_M blocks, most at m = min(E, T*K)."""
    used = min(num_experts, num_pairs)
    return used + (num_pairs - used) // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the T*K (token, slot) pairs by expert, each expert's run padded to a multiple of block_m.
    Four launches (a zeroed count, then three kernels), no host reads: graph capturable."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    dev = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(num_pairs, _ALIGN_BLOCK),)
    _rank_kernel[grid](ids, counts, ranks, num_pairs, BLOCK=_ALIGN_BLOCK)
    _plan_kernel[(1,)](
        counts, starts, block_expert, num_padded, sorted_ids, num_experts, num_pairs, blocks,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=32, BLOCK_R=1024,
    )  # fmt: skip
    _scatter_kernel[grid](ids, ranks, starts, sorted_ids, num_pairs, BLOCK=_ALIGN_BLOCK)
    return MoEAlignment(sorted_ids, block_expert, num_padded)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # one variant for every T
def _moe_gemm_kernel(
    a, b, c, topk_weights, sorted_ids, block_expert, num_padded,
    num_pairs, n_out, k_in, num_blocks,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    ROWS_PER_A: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """c[p, n] = (a[p // ROWS_PER_A] @ b[e]^T)[n] (times topk_weights[p]) for the BLOCK_M sorted pairs
    p of one block and BLOCK_N output columns; e is the block's expert, b[e] is [n_out, k_in]."""
    pid = tl.program_id(0)
    # GROUP_M blocks of rows take each column block in turn, so a weight tile is reused from L2
    num_n = tl.cdiv(n_out, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_size
    pid_n = (pid % group) // group_size
    if pid_m * BLOCK_M < tl.load(num_padded):
        pair = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = pair < num_pairs
        expert = tl.load(block_expert + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a + (pair // ROWS_PER_A)[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = b + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            k_ok = ks < k_in - k0
            a_tile = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
            b_tile = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(DOT_DTYPE)
            acc = tl.dot(a_tile, b_tile, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if MUL_ROUTED_WEIGHT:
            acc *= tl.load(topk_weights + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c + pair[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _moe_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor | None,
    align: MoEAlignment, num_pairs: int, rows_per_a: int, cfg: MoEConfig,
) -> None:  # fmt: skip
    blocks = align.block_expert.shape[0]
    n_out, k_in = w.shape[1], w.shape[2]
    dot_dtype, precision = dot_operands(a.dtype, a.device)
    grid = (blocks * triton.cdiv(n_out, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, topk_weights if topk_weights is not None else a, *align, num_pairs, n_out, k_in, blocks,
        *a.stride(), *w.stride(), *out.stride(),
        ROWS_PER_A=rows_per_a, MUL_ROUTED_WEIGHT=topk_weights is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _fused_moe_chunk(x, w_gate_up, w_down, topk_weights, topk_ids, out, cfg: MoEConfig) -> None:
    t, k = topk_ids.shape
    num_pairs = t * k
    align = moe_align(topk_ids, w_gate_up.shape[0], cfg.block_m)
    gate_up = torch.empty(num_pairs, w_gate_up.shape[1], dtype=x.dtype, device=x.device)
    _moe_gemm(x, w_gate_up, gate_up, None, align, num_pairs, k, cfg)
    act = silu_and_mul(gate_up)
    weights = topk_weights.reshape(-1)
    if k == 1:  # one pair per token: GEMM 2 writes the output rows itself
        _moe_gemm(act, w_down, out, weights, align, num_pairs, 1, cfg)
        return
    y = torch.empty(num_pairs, w_down.shape[1], dtype=x.dtype, device=x.device)
    _moe_gemm(act, w_down, y, weights, align, num_pairs, 1, cfg)
    torch.sum(y.view(t, k, -1), dim=1, out=out)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H] (gate rows first, then up rows, as F.linear weights);
    w_down [E, H, I]; topk_weights [T, K] float32; topk_ids [T, K] int (any int dtype, each in [0, E)).
    Returns [T, H] in x.dtype: sum_k topk_weights[t,k] * down_e(silu(gate_e x_t) * up_e x_t),
    e = topk_ids[t,k]. x may have any strides; the weights' dtype must be x's. `config` overrides the
    tiles (benchmarks); by default `moe_config` picks them from T, K and E."""
    t, h = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"weights ({w_gate_up.dtype}, {w_down.dtype}) must have x's dtype {x.dtype}")
    if w_gate_up.shape[2] != h or w_down.shape != (num_experts, h, two_inter // 2):
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit H={h}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}, T={t}")
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    for t0 in range(0, t, _CHUNK_TOKENS):
        t1 = min(t, t0 + _CHUNK_TOKENS)
        cfg = config or moe_config(t1 - t0, topk_ids.shape[1], num_experts, x.device)
        _fused_moe_chunk(x[t0:t1], w_gate_up, w_down, topk_weights[t0:t1], topk_ids[t0:t1], out[t0:t1], cfg)
    return out


def moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe as a per-expert torch loop: the test oracle and the benchmark baseline. Each expert's
    output is in x.dtype as F.linear returns it (torch rounds gate_up, silu and the product to x.dtype
    too); it is weighted and summed in fp32 and rounded to x.dtype once. One host read (how many pairs
    each expert has), so not graph capturable."""
    t, k = topk_ids.shape
    num_experts, two_inter, h = w_gate_up.shape
    inter = two_inter // 2
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    weights = topk_weights.reshape(-1).float()
    acc = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        gate_up = F.linear(x[tokens], w_gate_up[e])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w_down[e])
        acc.index_add_(0, tokens, y.float() * weights[pairs, None])
    return acc.to(x.dtype)
