"""`min_new_tokens`: until a request has that many output tokens, EOS and its stop_token_ids are
masked (even with ignore_eos, as SGLang does). Device tensors only: the (row, token, threshold)
triples are built when the batch changes, and each step compares them with the output lengths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.scheduler.host_copy import to_device
from services.scheduler.request import Req
from services.scheduler.sampling.processors import BatchPlan, LogitsProcessor


@dataclass
class _Plan:
    rows: torch.Tensor
    cols: torch.Tensor
    until: torch.Tensor  # output length from which the pair is no longer masked


class MinNewTokensProcessor(LogitsProcessor):
    name = "min_new_tokens"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._plan = BatchPlan(self._build)

    def uses(self, req: Req) -> bool:
        return req.sampling.min_new_tokens > 0

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], output_lens: torch.Tensor) -> None:
        plan = self._plan.get(reqs) if self.active else None
        if plan is None:
            return
        masked = output_lens[plan.rows, 0] < plan.until
        current = logits[plan.rows, plan.cols]
        logits[plan.rows, plan.cols] = current.masked_fill(masked, float("-inf"))

    def _build(self, reqs: Sequence[Req]) -> _Plan | None:
        rows, cols, until = [], [], []
        for i, r in enumerate(reqs):
            if r.sampling.min_new_tokens > 0:
                rows += [i] * len(r.min_new_mask)
                cols += r.min_new_mask
                until += [r.sampling.min_new_tokens] * len(r.min_new_mask)
        if not rows:
            return None
        dev = self.device
        return _Plan(to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev),
                     to_device(until, torch.int64, dev))  # fmt: skip
