"""The grammar bitmask kernel against the torch unpacking it replaces on CUDA: random masks over an
odd vocabulary (the last word partly past it), a subset of rows, fp32 and bf16. Under Triton's
interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py set TRITON_INTERPRET=1 without CUDA

from sglbus_kernels.grammar_mask import apply_bitmask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
    allowed = bits.view(words.shape[0], -1)[:, : logits.shape[1]]
    past = logits.shape[1] - allowed.shape[1]  # a mask narrower than the vocabulary: the rest banned
    allowed = torch.nn.functional.pad(allowed, (0, max(past, 0)))
    out[rows] = out[rows].masked_fill(allowed == 0, float("-inf"))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [70, 5003])
def test_kernel_masks_exactly_the_banned_tokens(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(dtype).to(DEVICE)
    words = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    words[1] = 0  # nothing allowed
    words[2] = -1  # everything allowed
    words = words.to(DEVICE)
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    want = reference(logits, words, rows)
    apply_bitmask(logits, words, rows)
    assert torch.equal(logits, want)
    assert torch.isinf(logits[0]).all() and not torch.isinf(logits[2]).any()


@pytest.mark.parametrize("words_wide", [1, 40])
def test_a_narrower_mask_bans_every_token_past_it(words_wide):
    """A grammar over the tokenizer's 49,152 tokens and a model vocabulary padded to 128,256: the mask
    covers the tokenizer; ids past it are never allowed, whatever the logits."""
    vocab = 1501
    g = torch.Generator().manual_seed(words_wide)
    logits = torch.randn(4, vocab, generator=g).to(DEVICE)
    words = torch.full((2, words_wide), -1, dtype=torch.int32)
    words[1] = 0
    words[1, 0] = 0b1010  # tokens 1 and 3 alone
    words = words.to(DEVICE)
    rows = torch.tensor([3, 1], device=DEVICE)
    want = reference(logits, words, rows)
    apply_bitmask(logits, words, rows)
    assert torch.equal(logits, want)
    assert (
        torch.isinf(logits[3, 32 * words_wide :]).all()
        and not torch.isinf(logits[3, : 32 * words_wide]).any()
    )
    assert torch.isinf(logits[1]).sum() == vocab - 2 and not torch.isinf(logits[0]).any()
