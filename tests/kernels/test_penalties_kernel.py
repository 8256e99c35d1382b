"""The fused penalty kernel against the torch passes it replaces on CUDA (DensePenaltyProcessor's
CPU path): frequency, presence and repetition over an odd vocabulary, a subset of the batch's rows in
another order than their state rows, with and without a repetition penalty. Under Triton's
interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py set TRITON_INTERPRET=1 without CUDA

from sglbus_kernels.penalties import apply_penalties  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(logits, idx, rows, counts, seen, freq, pres, rep):
    out = logits.clone()
    c = counts[rows]
    x = out[idx] - freq[:, None] * c - pres[:, None] * (c > 0)
    if rep is not None:
        hit = (c > 0) | seen[rows]
        x = torch.where(hit, torch.where(x > 0, x / rep[:, None], x * rep[:, None]), x)
    out[idx] = x
    return out


@pytest.mark.parametrize("with_rep", [False, True])
@pytest.mark.parametrize("vocab", [70, 5003])
def test_kernel_applies_the_penalties_of_the_torch_passes(with_rep, vocab):
    g = torch.Generator().manual_seed(vocab + with_rep)
    logits = (torch.randn(7, vocab, generator=g) * 4).to(DEVICE)
    counts = torch.randint(0, 3, (9, vocab), generator=g, dtype=torch.int32)
    counts[counts == 1] = 0  # most tokens unseen
    seen = torch.rand(9, vocab, generator=g) < 0.1
    idx, rows = torch.tensor([5, 0, 3]), torch.tensor([2, 8, 4])
    freq, pres = torch.tensor([0.5, 0.0, 1.1]), torch.tensor([0.0, 0.7, 1.1])
    rep = torch.tensor([1.3, 1.0, 0.1]) if with_rep else None
    args = [t.to(DEVICE) for t in (idx, rows, counts, seen, freq, pres)] + [
        None if rep is None else rep.to(DEVICE)
    ]
    want = reference(logits, *args)
    apply_penalties(logits, args[0], args[1], args[2], args[3], args[4], args[5], args[6])
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    untouched = [j for j in range(7) if j not in idx.tolist()]
    assert torch.equal(logits[untouched], want[untouched])
