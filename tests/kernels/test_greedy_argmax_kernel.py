"""The greedy-argmax kernel (the overlap path's all-greedy draw on CUDA) against the torch sampler it
stands in for: repaired rows (NaN, +-inf, values past the cap), ties at the first index, dead rows,
fp32 and bf16, a vocabulary that is not a multiple of the block. Under Triton's interpreter without
CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py set TRITON_INTERPRET=1 without CUDA

from services.scheduler.sampling.sampler import _LOGIT_CAP, SamplingInfo, sample  # noqa: E402
from sglbus_kernels.greedy_argmax import greedy_argmax  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 5003])
def test_kernel_picks_what_the_torch_sampler_picks(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g)
    logits[1, vocab // 2] = float("inf")
    logits[2, vocab - 1], logits[2, 3] = 1e35, 2e35  # both count as the cap: the first wins
    logits[3, ::2] = float("nan")
    logits[4] = float("nan")
    logits[5] = float("-inf")
    logits[6] = float("-inf")
    logits[6, vocab - 2] = -1e35  # past the cap, but allowed
    logits[7, 1] = logits[7, vocab - 1] = 50.0  # an exact tie: the first index, as torch.argmax
    logits[8, 0] = float("-inf")
    logits = logits.to(dtype)
    pos = torch.zeros(9, 1, dtype=torch.int64)
    greedy = SamplingInfo.build([SamplingParams(temperature=0)] * 9, vocab, "cpu")
    want = sample(logits.float().clone(), greedy, pos)
    got = greedy_argmax(logits.to(DEVICE), _LOGIT_CAP).cpu()
    assert got.tolist() == want.tolist()
    assert got[[1, 2, 4, 5, 6, 7]].tolist() == [vocab // 2, 3, -1, -1, vocab - 2, 1]
