"""The grammar bitmask applied to logits in place, in Triton: rows[i]'s logits keep the tokens whose
bit is set in mask[i] (bit t % 32 of int32 word t // 32) and become -inf elsewhere. One pass over the
masked rows, no [rows, vocab] temporary (the torch version unpacks one: 128 MB at 256 rows of a
128k vocabulary). A 2-D grid of (masked row, vocabulary block). A mask narrower than the vocabulary
(a grammar over the tokenizer's tokens, a model's vocabulary padded past them) bans every token past
its last word."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglbus_kernels.index_args import index_jit

_BLOCK = 4096


@index_jit("rows_ptr")
def _apply_bitmask_kernel(logits_ptr, stride_l, mask_ptr, stride_m, rows_ptr, vocab, mask_tokens,
                          BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    words = tl.load(mask_ptr + i * stride_m + cols // 32, mask=inside & (cols < mask_tokens), other=0)
    banned = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=inside & banned)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [B, V] (float, rows contiguous), mask [R, W] int32 (W <= ceil(V / 32): tokens from 32 W on
    are banned), rows [R] int64 row ids."""
    assert logits.stride(-1) == 1 and mask.dtype == torch.int32 and mask.stride(-1) == 1
    n, vocab = rows.numel(), logits.shape[1]
    if n == 0:
        return
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    grid = (n, triton.cdiv(vocab, block))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), mask, mask.stride(0), rows, vocab,
                                32 * mask.shape[1], BLOCK=block, num_warps=4)  # fmt: skip
