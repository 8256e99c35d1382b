"""The batch sizes CUDA graphs are captured for (no GPU needed to check them): every decode batch up
to the largest one has a bucket, and the padding of a batch stays small (a padding row costs its share
of the linear layers: buckets of 256 made graph steps of ~2,400 requests 4% slower than eager ones)."""

from __future__ import annotations

import pytest

from services.scheduler.cuda_graph import graph_buckets


@pytest.mark.parametrize("max_bs", [1, 7, 16, 100, 512, 1000, 4096])
def test_every_batch_has_a_bucket_with_little_padding(max_bs):
    buckets = graph_buckets(max_bs)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_bs and buckets[0] == 1
    for bs in range(1, max_bs + 1):
        padded = next(b for b in buckets if b >= bs)
        assert padded - bs < 64 and (bs < 64 or (padded - bs) <= bs / 4)


def test_past_512_the_buckets_are_64_apart():
    big = [b for b in graph_buckets(4096) if b > 512]
    assert big == list(range(576, 4097, 64))
