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


def test_short_extends_as_one_token_rows():
    """A step of short extends becomes one row per token (DECODE mode, a CUDA graph's shape): each row
    attends to its request's prefix and the tokens before it; the flat order and logits rows stay."""
    from services.scheduler.step_inputs import ROWS_MAX_EXTEND, StepInputs

    step = StepInputs(ids=[11, 12, 13, 14, 15], rows=[4, 7, 9], prefix_lens=[6, 20, 3],
                      extend_lens=[1, 3, 1], logits_idx=[0, 3, 4], num_tokens=5)  # fmt: skip
    assert step.fits_rows(max_tokens=5) and not step.fits_rows(max_tokens=4)
    step.as_rows()
    assert step.rows == [4, 7, 7, 7, 9] and step.prefix_lens == [6, 20, 21, 22, 3]
    fb = ForwardBatch.build(step.ids, step.rows, step.prefix_lens, step.extend_lens, torch.arange(5),
                            step.logits_idx, [], torch.device("cpu"))  # fmt: skip
    assert fb.mode is ForwardMode.DECODE and fb.num_decode == fb.batch_size == 5
    assert fb.positions.tolist() == [6, 20, 21, 22, 3] and fb.seq_lens.tolist() == [7, 21, 22, 23, 4]
    assert fb.logits_idx.tolist() == [0, 3, 4] and fb.input_ids.tolist() == [11, 12, 13, 14, 15]

    def fits(prefix, extend, lp=()):
        s = StepInputs(ids=[0] * sum(extend), rows=list(range(len(extend))), prefix_lens=prefix,
                       extend_lens=extend, lp_idx=list(lp), num_tokens=sum(extend))  # fmt: skip
        return s.fits_rows(max_tokens=4096)

    assert not fits([5, 5], [1, 1])  # a decode batch already is one
    assert not fits([0], [ROWS_MAX_EXTEND + 1])  # a prompt: the extend kernel reads its prefix once
    assert not fits([0, 9], [2, 1], lp=[0])  # prompt logprobs need the extend path's hidden states
    assert not fits([50_000], [8])  # each row re-reads a long prefix
    assert fits([50_000, 7], [1, 2])
