"""ForwardBatch.build: the flat layout of a mixed batch, and how many leading requests decode."""

from __future__ import annotations

import torch

from services.scheduler.forward_batch import ForwardBatch, ForwardMode


def build(prefix_lens, extend_lens, logits_idx=None):
    t = sum(extend_lens)
    ids, rows, slots = list(range(10, 10 + t)), list(range(len(extend_lens))), torch.arange(1, t + 1)
    return ForwardBatch.build(ids, rows, prefix_lens, extend_lens, slots, logits_idx, [], torch.device("cpu"))


def test_mixed_batch_layout_and_leading_decodes():
    fb = build([5, 7, 0, 3], [1, 1, 3, 1], logits_idx=[0, 1, 4, 5])
    assert fb.mode is ForwardMode.EXTEND
    assert fb.num_decode == 2  # the one-token request after the prefill is not leading
    assert fb.positions.tolist() == [5, 7, 0, 1, 2, 3]
    assert fb.extend_start_loc.tolist() == [0, 1, 2, 5]
    assert fb.seq_lens.tolist() == fb.seq_lens_cpu.tolist() == [6, 8, 3, 4]
    assert fb.extend_lens.tolist() == fb.extend_lens_cpu.tolist() == [1, 1, 3, 1]
    assert fb.prefix_lens.tolist() == [5, 7, 0, 3] and fb.req_pool_indices.tolist() == [0, 1, 2, 3]
    assert fb.input_ids.tolist() == list(range(10, 16)) and fb.logits_idx.tolist() == [0, 1, 4, 5]
    assert fb.max_extend_len == 3 and fb.lp_idx is None


def test_decode_batch_is_all_decode_and_prefill_batch_none():
    fb = build([4, 9], [1, 1])
    assert fb.mode is ForwardMode.DECODE and fb.num_decode == 2 and fb.logits_idx is None
    fb = build([0, 0], [4, 1], logits_idx=[3, 4])
    assert fb.num_decode == 0
