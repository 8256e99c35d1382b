"""Frequency, presence and repetition penalties applied to logits in place, in Triton: one pass over the
penalised rows that reads each row's logits, its output counts and (with a repetition penalty) its
prompt marks, and writes the logits back. The torch version does the same in ~20 [rows, vocab]
elementwise passes with temporaries: ~6 ms a step at 1,400 penalised rows of a 128k vocabulary on an
H200, against ~0.7 ms of traffic for this one. A 2-D grid of (penalised row, vocabulary block).

    x = logits[idx[u]] - freq[u] * counts[rows[u]] - pres[u] * (counts[rows[u]] > 0)
    seen = counts[rows[u]] > 0 or prompt_seen[rows[u]]
    logits[idx[u]] = where(seen, where(x > 0, x / rep[u], x * rep[u]), x)      (repetition only)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglbus_kernels.index_args import index_jit

_BLOCK = 4096


@index_jit("idx_ptr", "rows_ptr")
def _penalties_kernel(logits_ptr, stride_l, idx_ptr, rows_ptr, counts_ptr, stride_c, seen_ptr,
                      stride_s, freq_ptr, pres_ptr, rep_ptr, vocab,
                      HAS_REP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    u = tl.program_id(0)
    i = tl.load(idx_ptr + u).to(tl.int64)
    row = tl.load(rows_ptr + u).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + i * stride_l + cols, mask=inside, other=0.0)
    counts = tl.load(counts_ptr + row * stride_c + cols, mask=inside, other=0)
    freq = tl.load(freq_ptr + u)
    pres = tl.load(pres_ptr + u)
    x = x - freq * counts.to(tl.float32) - pres * (counts > 0).to(tl.float32)  # the torch version's order
    if HAS_REP:
        rep = tl.load(rep_ptr + u)
        seen = (counts > 0) | (tl.load(seen_ptr + row * stride_s + cols, mask=inside, other=0) != 0)
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    tl.store(logits_ptr + i * stride_l + cols, x, mask=inside)


def apply_penalties(
    logits: torch.Tensor,
    idx: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor | None,
    freq: torch.Tensor,
    pres: torch.Tensor,
    rep: torch.Tensor | None,
) -> None:
    """logits [B, V] float32; idx [U] its penalised rows; rows [U] their rows of counts [R, V] int32 and
    prompt_seen [R, V] bool; freq, pres, rep [U] float32 (rep None: no repetition penalty)."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1 and counts.dtype == torch.int32
    n, vocab = idx.numel(), logits.shape[1]
    if n == 0:
        return
    has_rep = rep is not None
    seen = prompt_seen.view(torch.uint8) if has_rep and prompt_seen is not None else counts
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    grid = (n, triton.cdiv(vocab, block))
    _penalties_kernel[grid](logits, logits.stride(0), idx, rows, counts, counts.stride(0), seen,
                            seen.stride(0), freq, pres, rep if has_rep else freq, vocab,
                            HAS_REP=has_rep, BLOCK=block, num_warps=8)  # fmt: skip
