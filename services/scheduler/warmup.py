"""Start-up warm-up on CUDA: run every kind of step once before the first request, so the Triton
kernels compile (and cuBLAS and the caching allocator settle) outside any request's time.

On a fresh machine each kernel variant compiles at its first use, 0.6-0.9 s on an H200; without this
the first mixed prefill + decode steps of a workload took 0.8-0.9 s instead of 0.2 s (docs/benchmarks.md).
The variants a step can pick are few: the decode kernel's split count (a power of two chosen from the
batch size, sglbus_kernels/decode_attention.py), the extend kernel, and the fused layer kernels; index
arrays are exempt from alignment specialisation (sglbus_kernels/index_args.py), so nothing else multiplies
them. The warm-up runs eager decode batches of 1, 2, 4 .. 128 requests (every split count), one mixed
batch (decodes, then extends with and without a cached prefix) and a greedy draw of its logits, plus
the grammar bitmask and penalty kernels. Every row is req_to_token's padding row and every new token
goes to KV slot 0, which is never handed out, so no request's state is touched.
"""

from __future__ import annotations

import logging
import time

import torch

from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.sampling.sampler import SamplingInfo
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
# (prefix, new tokens) of the mixed batch's requests: two decodes, an extend over a cached prefix,
# a fresh prefill
_MIXED = ((7, 1), (7, 1), (16, 24), (0, 40))


def _batch(runner, shape: list[tuple[int, int]], logits_idx: list[int] | None) -> ForwardBatch:
    pad = runner.req_to_token.padding_row
    tokens = sum(n for _, n in shape)
    return ForwardBatch.build(
        input_ids=[0] * tokens,
        rows=[pad] * len(shape),
        prefix_lens=[p for p, _ in shape],
        extend_lens=[n for _, n in shape],
        out_cache_loc=torch.zeros(tokens, dtype=torch.int64, device=runner.device),
        logits_idx=logits_idx,
        lp_idx=[],
        device=runner.device,
    )


@torch.inference_mode()
def warm_up(runner) -> float:
    """Runs the warm-up steps on runner (a ModelRunner; it calls this on CUDA); returns the seconds taken."""
    t0 = time.perf_counter()
    limit = runner.max_running_requests
    for bs in (b for b in _DECODE_BATCHES if b <= limit):
        fb = _batch(runner, [(7, 1)] * bs, None)
        runner.attn.prepare(fb)
        runner.model(fb, runner.attn)  # eager, as the decode part of a mixed step runs
    ends = torch.tensor([n for _, n in _MIXED]).cumsum(0) - 1
    logits = runner.forward(_batch(runner, list(_MIXED), ends.tolist())).logits
    info = SamplingInfo.build([SamplingParams(temperature=0.0)] * len(_MIXED), logits.shape[1], runner.device)
    runner.sample(logits, info, torch.zeros(len(_MIXED), 1, dtype=torch.int64, device=runner.device))
    if runner.device.type == "cuda":
        from sglbus_kernels.grammar_mask import apply_bitmask

        words = torch.full((1, (logits.shape[1] + 31) // 32), -1, dtype=torch.int32, device=runner.device)
        one = torch.zeros(1, dtype=torch.int64, device=runner.device)
        apply_bitmask(logits, words, one)
        from sglbus_kernels.penalties import (
            apply_penalties,
        )  # its two variants, on float32 rows as SampleStep's

        rows, zero = logits[:1].float(), torch.zeros(1, device=runner.device)
        counts = torch.zeros(1, logits.shape[1], dtype=torch.int32, device=runner.device)
        for rep in (None, zero + 1.0):
            apply_penalties(rows, one, one, counts, counts.bool(), zero, zero, rep)
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0
