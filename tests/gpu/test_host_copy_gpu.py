"""to_device's pinned ring on CUDA: copies of every size and dtype arrive intact, across several laps
of the ring while earlier copies are still queued behind device work."""

from __future__ import annotations

import pytest
import torch

from services.scheduler import host_copy
from services.scheduler.host_copy import to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_copies_survive_laps_of_the_ring():
    dev = torch.device("cuda")
    big = torch.randn(2048, 2048, device=dev)
    sent, got = [], []
    lap = host_copy._SEGMENTS * host_copy._SEGMENT_BYTES
    total = 0
    i = 0
    while total < 3 * lap:
        big = big @ big / 2048  # keeps the stream busy, so copies queue behind it
        n = [0, 1, 7, 1000, 300_000, 1_200_000][i % 6]
        values = torch.arange(i, i + n, dtype=torch.int64)
        sent.append(values)
        got.append(to_device(values, torch.int64, dev))
        total += 8 * n
        i += 1
    flags = to_device([True, False, True], torch.bool, dev)
    floats = to_device([0.5, -2.0], torch.float32, dev)
    torch.cuda.synchronize()
    for a, b in zip(sent, got, strict=True):
        assert torch.equal(a, b.cpu())
    assert flags.tolist() == [True, False, True] and floats.tolist() == [0.5, -2.0]


def test_a_copy_larger_than_a_segment_is_pinned_on_its_own():
    values = torch.arange(host_copy._SEGMENT_BYTES // 8 + 5, dtype=torch.int64)
    out = to_device(values, torch.int64, torch.device("cuda"))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), values)
