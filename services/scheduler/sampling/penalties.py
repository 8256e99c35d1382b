"""Penalties, `min_new_tokens` and `logit_bias`, applied to a batch's logits in place before sampling.

State, per request row (its req_to_token row):

    out_counts[row, token]   how often `token` appeared in the request's output (dense int32)
    seen[row]                the tokens a penalty can touch: the output's, plus the prompt's when
                             repetition_penalty is set

A step touches only the (request, token) pairs in `seen`, a few thousand gathers, instead of whole
[batch, vocab] passes (a dense version cost 30 ms per 64-request step on 2 CPU cores). The pair lists
are built when the batch changes and grow by the newly seen sampled tokens. Nothing is allocated
until a request uses a penalty; a batch where none does costs one check.
Definitions (as SGLang and OpenAI): frequency subtracts penalty * count, presence subtracts penalty
once a token appeared, repetition divides positive logits (multiplies negative ones) of tokens seen in
the prompt or output; min_new_tokens masks EOS and stop_token_ids until reached; logit_bias adds,
clamped to +-MAX_BIAS (already certainty either way; 1e308 would overflow float32 to inf).
`apply` and `on_sample` compute everything before writing, so when one raises nothing changed and the
scheduler can retry request by request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.scheduler.request import Req

MAX_BIAS = 1e4


def uses_counts(req: Req) -> bool:
    s = req.sampling
    return s.frequency_penalty != 0.0 or s.presence_penalty != 0.0 or s.repetition_penalty != 1.0


class Penalizer:
    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        self.out_counts: torch.Tensor | None = None
        self.seen: dict[int, set[int]] = {}
        self._plan_key: tuple[int, ...] | None = None
        self._plan: _Plan | None = None

    @torch.inference_mode()  # the logits are inference tensors; the state must be too
    def on_admit(self, req: Req) -> None:
        """A request got a row: rebuild its state (its output is non-empty after a retraction)."""
        row = req.row
        if not uses_counts(req):
            self.seen.pop(row, None)
            return
        if self.out_counts is None:
            self.out_counts = torch.zeros(self.rows, self.vocab_size, dtype=torch.int32, device=self.device)
        self.out_counts[row].zero_()
        if req.output:
            out = torch.tensor(req.output, dtype=torch.int64, device=self.device)
            self.out_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        seen = set(req.output)
        if req.sampling.repetition_penalty != 1.0:
            seen.update(req.prompt)
        self.seen[row] = seen

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        plan = self._plan_for(reqs)
        if plan is None:
            return
        vals = None
        if plan.pair_b.numel():
            b, t = plan.pair_b, plan.pair_t
            counts = self.out_counts[plan.rows_b[b], t].float()
            vals = logits[b, t] - plan.freq_b[b] * counts - plan.pres_b[b] * (counts > 0)
            if plan.any_rep:
                rep = plan.rep_b[b]
                vals = torch.where(vals > 0, vals / rep, vals * rep)
        # min_new_tokens depends on each request's output length, so it is rebuilt every step
        rows, cols = [], []
        for i, r in plan.min_new:
            if len(r.output) < r.sampling.min_new_tokens:
                ids = r.min_new_mask
                rows += [i] * len(ids)
                cols += ids
        dev = logits.device
        masked = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)) if rows else None
        if vals is not None:
            logits[plan.pair_b, plan.pair_t] = vals
        if plan.bias_rows is not None:
            logits.index_put_((plan.bias_rows, plan.bias_cols), plan.bias_vals, accumulate=True)
        if masked is not None:
            logits[masked] = float("-inf")

    @torch.inference_mode()
    def on_sample(self, reqs: Sequence[Req], tokens: torch.Tensor) -> None:
        plan = self._plan_for(reqs)
        if plan is None or plan.count_idx is None:
            return
        sampled = tokens.index_select(0, plan.count_idx)
        new = [
            (i, row, t)
            for i, row, t in zip(plan.counted_b, plan.counted_rows, sampled.tolist(), strict=True)
            if t not in self.seen[row]
        ]
        ones = torch.ones(plan.count_idx.numel(), dtype=torch.int32, device=self.device)
        dev = self.device
        more = None
        if new:
            more = (
                torch.tensor([i for i, _, _ in new], device=dev),
                torch.tensor([t for *_, t in new], device=dev),
            )
        self.out_counts.index_put_((plan.count_rows, sampled), ones, accumulate=True)
        if more is not None:
            for _, row, t in new:
                self.seen[row].add(t)
            plan.pair_b = torch.cat((plan.pair_b, more[0]))
            plan.pair_t = torch.cat((plan.pair_t, more[1]))

    def _plan_for(self, reqs: Sequence[Req]) -> _Plan | None:
        key = _key(reqs)
        if key != self._plan_key:  # rebuilt only when the batch changes
            self._plan_key, self._plan = key, _Plan.build(reqs, self.seen, self.device)
        return self._plan


def _key(reqs: Sequence[Req]) -> tuple[int, ...]:
    return tuple(r.uid for r in reqs)


class _Plan:
    # requests with count-based penalties: their batch indices (tensor and list) and rows
    count_idx: torch.Tensor | None = None
    count_rows: torch.Tensor
    counted_b: list[int]
    counted_rows: list[int]
    # (batch index, token) pairs the penalties touch; per batch index: row and parameters
    pair_b: torch.Tensor
    pair_t: torch.Tensor
    rows_b: torch.Tensor
    freq_b: torch.Tensor
    pres_b: torch.Tensor
    rep_b: torch.Tensor
    any_rep: bool = False
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor
    bias_vals: torch.Tensor
    min_new: list[tuple[int, Req]]

    @classmethod
    def build(cls, reqs: Sequence[Req], seen: dict[int, set[int]], device: torch.device) -> _Plan | None:
        counted = [(i, r) for i, r in enumerate(reqs) if uses_counts(r)]
        biased = [(i, r) for i, r in enumerate(reqs) if r.sampling.logit_bias]
        min_new = [(i, r) for i, r in enumerate(reqs) if r.sampling.min_new_tokens > 0]
        if not (counted or biased or min_new):
            return None
        plan = cls()
        plan.min_new = min_new
        empty = torch.empty(0, dtype=torch.int64, device=device)
        plan.pair_b = plan.pair_t = empty
        if counted:
            plan.counted_b = [i for i, _ in counted]
            plan.counted_rows = [r.row for _, r in counted]
            plan.count_idx = torch.tensor(plan.counted_b, device=device)
            plan.count_rows = torch.tensor(plan.counted_rows, device=device)
            n = len(reqs)
            rows, freq, pres, rep = [0] * n, [0.0] * n, [0.0] * n, [1.0] * n
            pair_b: list[int] = []
            pair_t: list[int] = []
            for i, r in counted:
                s = r.sampling
                rows[i], freq[i], pres[i], rep[i] = (
                    r.row,
                    s.frequency_penalty,
                    s.presence_penalty,
                    s.repetition_penalty,
                )
                tokens = seen[r.row]
                pair_b += [i] * len(tokens)
                pair_t += tokens
            plan.rows_b = torch.tensor(rows, device=device)
            plan.freq_b = torch.tensor(freq, dtype=torch.float32, device=device)
            plan.pres_b = torch.tensor(pres, dtype=torch.float32, device=device)
            plan.rep_b = torch.tensor(rep, dtype=torch.float32, device=device)
            plan.any_rep = any(x != 1.0 for x in rep)
            plan.pair_b = torch.tensor(pair_b, dtype=torch.int64, device=device)
            plan.pair_t = torch.tensor(pair_t, dtype=torch.int64, device=device)
        if biased:
            rows_, cols, vals = [], [], []
            for i, r in biased:
                for token, bias in r.sampling.logit_bias.items():
                    rows_.append(i)
                    cols.append(int(token))
                    vals.append(min(max(float(bias), -MAX_BIAS), MAX_BIAS))
            plan.bias_rows = torch.tensor(rows_, device=device)
            plan.bias_cols = torch.tensor(cols, device=device)
            plan.bias_vals = torch.tensor(vals, dtype=torch.float32, device=device)
        return plan
