"""`logit_bias`: adds each request's {token: bias} to its row, clamped to +-MAX_BIAS (already
certainty either way; 1e308 would overflow float32 to inf)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.scheduler.host_copy import to_device
from services.scheduler.request import Req
from services.scheduler.sampling.processors import BatchPlan, LogitsProcessor

MAX_BIAS = 1e4


@dataclass
class _Plan:
    rows: torch.Tensor
    cols: torch.Tensor
    vals: torch.Tensor


class LogitBiasProcessor(LogitsProcessor):
    name = "logit_bias"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._plan = BatchPlan(self._build)

    def uses(self, req: Req) -> bool:
        return bool(req.sampling.logit_bias)

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], output_lens: torch.Tensor) -> None:
        plan = self._plan.get(reqs) if self.active else None
        if plan is not None:
            logits.index_put_((plan.rows, plan.cols), plan.vals, accumulate=True)

    def _build(self, reqs: Sequence[Req]) -> _Plan | None:
        rows, cols, vals = [], [], []
        for i, r in enumerate(reqs):
            for token, bias in (r.sampling.logit_bias or {}).items():
                rows.append(i)
                cols.append(int(token))
                vals.append(min(max(float(bias), -MAX_BIAS), MAX_BIAS))
        if not rows:
            return None
        dev = self.device
        return _Plan(to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev),
                     to_device(vals, torch.float32, dev))  # fmt: skip
