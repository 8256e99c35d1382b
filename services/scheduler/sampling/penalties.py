"""Penalties, `min_new_tokens` and `logit_bias`, applied to a batch's logits in place before sampling.

State lives in tensors indexed by the request's req_to_token row, so a step is a few gathers:

    out_counts[row, token]   how often `token` appeared in the request's output (frequency/presence/
                             repetition penalties)
    in_prompt[row, token]    the token appears in the prompt (repetition penalty only)

Both are allocated on first use; a batch where no request uses any of this costs one flag check.
Definitions (as SGLang and OpenAI): frequency subtracts penalty * count, presence subtracts penalty
once a token appeared, repetition divides positive logits (multiplies negative ones) of tokens seen in
the prompt or output; min_new_tokens masks EOS and stop_token_ids until reached; logit_bias adds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.scheduler.request import Req


def uses_counts(req: Req) -> bool:
    s = req.sampling
    return s.frequency_penalty != 0.0 or s.presence_penalty != 0.0 or s.repetition_penalty != 1.0


class Penalizer:
    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        self.out_counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self._plan_key: tuple[str, ...] | None = None
        self._plan: _Plan | None = None

    @torch.inference_mode()  # the logits are inference tensors; the state must be too
    def on_admit(self, req: Req) -> None:
        """A request got a row: rebuild its state (its output is non-empty after a retraction)."""
        if not uses_counts(req):
            return
        if self.out_counts is None:
            self.out_counts = torch.zeros(self.rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(self.rows, self.vocab_size, dtype=torch.bool, device=self.device)
        row = req.row
        self.out_counts[row].zero_()
        if req.output:
            out = torch.tensor(req.output, dtype=torch.int64, device=self.device)
            self.out_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        self.in_prompt[row].zero_()
        if req.sampling.repetition_penalty != 1.0:
            self.in_prompt[row, torch.tensor(req.prompt, dtype=torch.int64, device=self.device)] = True

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        plan = self._plan_for(reqs)
        if plan is None:
            return
        if plan.count_idx is not None:
            rows = plan.count_rows
            counts = self.out_counts.index_select(0, rows)
            sub = logits.index_select(0, plan.count_idx)
            sub -= plan.freq * counts + plan.pres * (counts > 0)
            if plan.any_rep:
                seen = (counts > 0) | self.in_prompt.index_select(0, rows)
                sub = torch.where(seen, torch.where(sub > 0, sub / plan.rep, sub * plan.rep), sub)
            logits.index_copy_(0, plan.count_idx, sub)
        if plan.bias_rows is not None:
            logits.index_put_((plan.bias_rows, plan.bias_cols), plan.bias_vals, accumulate=True)
        # min_new_tokens depends on each request's output length, so it is rebuilt every step
        rows, cols = [], []
        for i, r in plan.min_new:
            if len(r.output) < r.sampling.min_new_tokens:
                ids = r.min_new_mask
                rows += [i] * len(ids)
                cols += ids
        if rows:
            dev = logits.device
            logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")

    @torch.inference_mode()
    def on_sample(self, reqs: Sequence[Req], tokens: torch.Tensor) -> None:
        plan = self._plan
        if plan is None or plan.count_idx is None or self._plan_key != _key(reqs):
            return
        self.out_counts.index_put_(
            (plan.count_rows, tokens.index_select(0, plan.count_idx)),
            torch.ones(plan.count_idx.numel(), dtype=torch.int32, device=self.device),
            accumulate=True,
        )

    def _plan_for(self, reqs: Sequence[Req]) -> _Plan | None:
        key = _key(reqs)
        if key != self._plan_key:  # rebuilt only when the batch changes
            self._plan_key, self._plan = key, _Plan.build(reqs, self.vocab_size, self.device)
        return self._plan


def _key(reqs: Sequence[Req]) -> tuple[str, ...]:
    return tuple(r.rid for r in reqs)


class _Plan:
    count_idx: torch.Tensor | None = None  # batch indices of requests with count-based penalties
    count_rows: torch.Tensor
    freq: torch.Tensor
    pres: torch.Tensor
    rep: torch.Tensor
    any_rep: bool = False
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor
    bias_vals: torch.Tensor
    min_new: list[tuple[int, Req]]

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> _Plan | None:
        counted = [(i, r) for i, r in enumerate(reqs) if uses_counts(r)]
        biased = [(i, r) for i, r in enumerate(reqs) if r.sampling.logit_bias]
        min_new = [(i, r) for i, r in enumerate(reqs) if r.sampling.min_new_tokens > 0]
        if not (counted or biased or min_new):
            return None
        plan = cls()
        plan.min_new = min_new
        if counted:

            def col(values: list[float]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

            plan.count_idx = torch.tensor([i for i, _ in counted], device=device)
            plan.count_rows = torch.tensor([r.row for _, r in counted], device=device)
            plan.freq = col([r.sampling.frequency_penalty for _, r in counted])
            plan.pres = col([r.sampling.presence_penalty for _, r in counted])
            plan.rep = col([r.sampling.repetition_penalty for _, r in counted])
            plan.any_rep = any(r.sampling.repetition_penalty != 1.0 for _, r in counted)
        if biased:
            rows, cols, vals = [], [], []
            for i, r in biased:
                for token, bias in r.sampling.logit_bias.items():
                    rows.append(i)
                    cols.append(int(token))
                    vals.append(float(bias))
            plan.bias_rows = torch.tensor(rows, device=device)
            plan.bias_cols = torch.tensor(cols, device=device)
            plan.bias_vals = torch.tensor(vals, dtype=torch.float32, device=device)
        return plan
