"""Frequency, presence and repetition penalties on dense per-row state: the GPU path.

    counts[row, token]        how often `token` appeared in the output of the request in that
                              req_to_token row (int32)
    prompt_seen[row, token]   whether it is in that request's prompt (only for repetition_penalty)

On CUDA a step applies all three in one Triton pass over the penalised rows (sglbus_kernels/penalties.py:
each row's logits, counts and prompt marks read once, the logits written in place); elsewhere it
gathers the rows, applies them in [U, vocab] torch passes and scatters them back (~20 passes with
temporaries: ~6 ms a step at 1,400 penalised rows of a 128k vocabulary on an H200, against ~0.7 ms
for the kernel). The drawn tokens are counted with one `index_put_` on the device. No per-request
Python and no host sync in the step, whatever the batch. On a CPU the
same passes cost far more than the sparse pairs of `PenaltyProcessor` (penalties.py), which the CPU
uses; both follow the same definitions (SGLang's and OpenAI's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.scheduler.host_copy import to_device
from services.scheduler.request import Req
from services.scheduler.sampling.penalties import uses_counts
from services.scheduler.sampling.processors import BatchPlan, LogitsProcessor
from services.scheduler.sampling.sampler import row_slices


@dataclass
class _Plan:
    idx: torch.Tensor  # [U] batch indices of the requests that use a penalty
    rows: torch.Tensor  # [U] their req_to_token rows
    freq: torch.Tensor  # [U, 1]
    pres: torch.Tensor  # [U, 1]
    rep: torch.Tensor | None  # [U, 1], None when no request of the batch sets repetition_penalty


class DensePenaltyProcessor(LogitsProcessor):
    name = "penalties"

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self._plan = BatchPlan(self._build)
        self._admitted: dict[int, Req] = {}  # row -> request admitted since the last step

    def uses(self, req: Req) -> bool:
        return uses_counts(req)

    @torch.inference_mode()
    def admit(self, req: Req) -> None:
        """Queue the request's rows for a rebuild (its output is non-empty after a retraction); the
        step's admissions are written together, before the next apply (`_write_admitted`)."""
        if not uses_counts(req):
            return
        if self.counts is None:
            shape = (self.rows, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self._admitted[req.row] = req
        super().admit(req)

    def release(self, req: Req) -> None:
        if req.row is not None and self._admitted.get(req.row) is req:
            del self._admitted[req.row]
        super().release(req)

    def _write_admitted(self) -> None:
        """Zero the admitted requests' rows, count their output so far and mark their prompts: three
        device writes for all of them, from one packed host copy."""
        if not self._admitted:
            return
        reqs = list(self._admitted.values())
        rows = [r.row for r in reqs]
        out_rows = [r.row for r in reqs for _ in r.output]
        out_tokens = [t for r in reqs for t in r.output]
        seen = [r for r in reqs if r.sampling.repetition_penalty != 1.0]
        seen_rows = [r.row for r in seen for _ in r.prompt]
        seen_tokens = [t for r in seen for t in r.prompt]
        packed = to_device(rows + out_rows + out_tokens + seen_rows + seen_tokens, torch.int64, self.device)
        sizes = (len(rows), len(out_rows), len(out_tokens), len(seen_rows), len(seen_tokens))
        rows_d, out_rows_d, out_tokens_d, seen_rows_d, seen_tokens_d = packed.split(sizes)
        # index_fill_ takes its value as a kernel argument; `t[idx] = 0` may copy a CPU scalar to the
        # device first, and a blocking copy waits for the step on the GPU
        self.counts.index_fill_(0, rows_d, 0)
        self.prompt_seen.index_fill_(0, rows_d, False)
        if out_tokens:
            ones = torch.ones(len(out_tokens), dtype=torch.int32, device=self.device)
            self.counts.index_put_((out_rows_d, out_tokens_d), ones, accumulate=True)
        if seen_tokens:
            self.prompt_seen.view(-1).index_fill_(0, seen_rows_d * self.vocab_size + seen_tokens_d, True)
        self._admitted.clear()

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], output_lens: torch.Tensor) -> None:
        plan = self._plan.get(reqs) if self.active else None
        if plan is None:
            return
        self._write_admitted()
        if logits.is_cuda and logits.dtype == torch.float32:  # one fused pass (sglbus_kernels/penalties.py)
            from sglbus_kernels.penalties import apply_penalties

            rep = None if plan.rep is None else plan.rep.view(-1)
            apply_penalties(logits, plan.idx, plan.rows, self.counts, self.prompt_seen, plan.freq.view(-1),
                            plan.pres.view(-1), rep)  # fmt: skip
            return
        # in slices of rows, as the sampler draws: [U, vocab] temporaries of a 2,400-row batch would
        # take ~8 GB at once
        for a, b in row_slices(plan.idx.numel(), self.vocab_size):
            idx, rows_of = plan.idx[a:b], plan.rows[a:b]
            counts = self.counts[rows_of]
            rows = logits[idx] - plan.freq[a:b] * counts - plan.pres[a:b] * (counts > 0)
            if plan.rep is not None:
                rep = plan.rep[a:b]
                seen = (counts > 0) | self.prompt_seen[rows_of]
                rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
            logits[idx] = rows

    @torch.inference_mode()
    def on_sample(self, reqs: Sequence[Req], tokens: torch.Tensor) -> None:
        plan = self._plan.get(reqs) if self.active else None
        if plan is None:
            return
        self._write_admitted()
        ones = torch.ones(plan.rows.numel(), dtype=torch.int32, device=self.device)
        self.counts.index_put_((plan.rows, tokens[plan.idx]), ones, accumulate=True)

    def _build(self, reqs: Sequence[Req]) -> _Plan | None:
        used = [(i, r) for i, r in enumerate(reqs) if uses_counts(r)]
        if not used:
            return None
        dev = self.device

        def col(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, dev).unsqueeze(1)

        reps = [r.sampling.repetition_penalty for _, r in used]
        return _Plan(
            idx=to_device([i for i, _ in used], torch.int64, dev),
            rows=to_device([r.row for _, r in used], torch.int64, dev),
            freq=col([r.sampling.frequency_penalty for _, r in used]),
            pres=col([r.sampling.presence_penalty for _, r in used]),
            rep=col(reps) if any(x != 1.0 for x in reps) else None,
        )
