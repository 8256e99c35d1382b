"""`index_jit`: triton.jit for kernels that read per-request index arrays one scalar at a time.

Those arrays (request rows, lengths, token offsets, KV slots, positions) reach the kernels as views
into one packed per-step buffer (ForwardBatch.build) or as slices of one, so whether an array starts
on a 16-byte boundary changes from step to step with the batch's token and request counts. By default
Triton compiles a separate variant for each alignment of each pointer argument, and on a fresh machine
every new variant compiled inside a serving step (0.6-0.9 s each on an H200, docs/benchmarks.md).
A scalar load gains nothing from alignment, so these arguments are exempt: one variant serves every
step, and the start-up warm-up (services/scheduler/warmup.py) compiles it before the first request.
"""

from __future__ import annotations

import triton


def index_jit(*index_args: str):
    """@index_jit("seq_lens", ...): triton.jit, without alignment specialisation on the named pointers."""
    return triton.jit(do_not_specialize_on_alignment=list(index_args))
