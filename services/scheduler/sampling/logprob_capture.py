"""Output logprobs as a logits processor: it runs first, so it sees the model's raw distribution
(log_softmax of the float32 logits before penalties, bias, masks, temperature or top-k/p), and once
the tokens are drawn it computes each asking request's row (logprobs.py); the scheduler appends it to
`req.lp_out` with the token (`take`).

The captured rows wait keyed by request uid between `apply` and `on_sample` (a request ended in
between leaves its row until `release`), so a retry request by request finds what it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.scheduler import logprobs
from services.scheduler.host_copy import to_device
from services.scheduler.request import Req
from services.scheduler.sampling.processors import LogitsProcessor


class LogprobCapture(LogitsProcessor):
    name = "output logprobs"

    def __init__(self) -> None:
        super().__init__()
        self._raw: dict[int, tuple[torch.Tensor, int]] = {}  # uid -> (log-probs, its row there)
        self._drawn: list[tuple[Req, Any]] = []

    def uses(self, req: Req) -> bool:
        return req.lp is not None

    def release(self, req: Req) -> None:
        self._raw.pop(req.uid, None)
        super().release(req)

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], output_lens: torch.Tensor) -> None:
        if not self.active:
            return
        asked = [i for i, r in enumerate(reqs) if r.lp is not None]
        if not asked:
            return
        lp = torch.log_softmax(logits[to_device(asked, torch.int64, logits.device)], dim=-1)
        for j, i in enumerate(asked):
            self._raw[reqs[i].uid] = (lp, j)

    @torch.inference_mode()
    def on_sample(self, reqs: Sequence[Req], tokens: torch.Tensor) -> None:
        if not self._raw:
            return
        picked = [(j, r) for j, r in enumerate(reqs) if r.uid in self._raw]
        if not picked:
            return
        parts = [self._raw[r.uid] for _, r in picked]
        base = parts[0][0]
        dev = tokens.device
        if all(t is base for t, _ in parts):
            raw = base[torch.tensor([row for _, row in parts], device=base.device)]
        else:
            raw = torch.stack([t[row] for t, row in parts])
        sampled = tokens[torch.tensor([j for j, _ in picked], device=dev)]
        rows = logprobs.output_rows(
            raw, sampled, [r.lp.top_k for _, r in picked], [r.lp.token_ids for _, r in picked]
        )
        for (_, r), row in zip(picked, rows, strict=True):  # written only once every row was computed
            self._drawn.append((r, row))
            del self._raw[r.uid]

    def take(self) -> list[tuple[Req, Any]]:
        """This step's rows, (request, row): they join `req.lp_out` when the step's tokens do (under
        overlap scheduling the next step is drawn before this one's tokens are processed)."""
        drawn, self._drawn = self._drawn, []
        return drawn
