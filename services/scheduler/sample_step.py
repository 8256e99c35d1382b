"""From the forward's output to this step's tokens and logprobs, with failures kept to the request that
caused them.

Every stage (prompt logprobs, penalties, sampling, penalty bookkeeping, output logprobs) runs batched
first. Only when a batched stage raises is it retried request by request (`_one_by_one`), and only the
requests whose own row fails are ended (abort, 500); `_release_finished` in the scheduler reports them
and frees their KV. The common step pays no per-request Python work for this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.logprobs import input_rows, output_rows
from services.scheduler.model_runner import ModelRunner
from services.scheduler.request import Req
from services.scheduler.sampling.penalties import Penalizer
from services.scheduler.sampling.sampler import SamplingInfo

log = logging.getLogger(__name__)


class SampleStep:
    """The sampling stage of the scheduler's step; keeps the batch's SamplingInfo between steps."""

    def __init__(self, runner: ModelRunner, penalizer: Penalizer, stats: dict[str, Any]) -> None:
        self.runner, self.penalizer, self.stats = runner, penalizer, stats
        self.vocab_size = runner.model_config.vocab_size
        self._sampling: tuple[tuple[int, ...], SamplingInfo] | None = None
        self.failures = 0  # requests ended by a failure of their own in the current step

    def input_logprobs(self, fb: ForwardBatch, lp_reqs: list[tuple[Req, int]]) -> None:
        """Prompt logprobs for this step's positions of each of `lp_reqs` (request, count)."""
        assert fb.lp_hidden is not None
        row = 0
        for r, m in lp_reqs:
            a = r.lp_pos
            targets = r.prompt[a + 1 : a + 1 + m]
            hidden = fb.lp_hidden[row : row + m]
            try:
                r.lp_in += input_rows(hidden, self.runner.model.logits, targets, r.lp.top_k, r.lp.token_ids)
                r.lp_pos += m
            except Exception as e:
                log.exception("prompt logprobs failed for request %s", r.rid)
                self.fail(r, "prompt logprobs", e)
            row += m
        fb.lp_hidden = None

    def sample(self, logits: torch.Tensor, samplers: list[Req]) -> list[int | None]:
        """A token per sampler; None for a request that failed alone in this step (it is ended). A
        batched stage that raises is retried request by request (`_one_by_one`)."""
        asked = [i for i, r in enumerate(samplers) if r.lp is not None]
        # the raw distribution, before penalties touch the logits in place
        raw = torch.log_softmax(logits[asked], dim=-1) if asked else None
        pen = self.penalizer
        try:
            pen.apply(logits, samplers)
        except Exception:  # apply writes nothing when it raises, so no row is penalised twice
            self._one_by_one(
                "penalties", samplers, lambda i: pen.apply(logits[i : i + 1], samplers[i : i + 1])
            )
        try:
            drawn = self._draw(logits, samplers)
        except Exception:
            rows = self._one_by_one(
                "sampling", samplers, lambda i: self._draw(logits[i : i + 1], samplers[i : i + 1])
            )
            none = torch.tensor([-1], device=logits.device)
            drawn = torch.cat([none if t is None else t for t in rows])
        tokens = drawn.tolist()
        if min(tokens) < 0:  # the sampler found no usable logit in these rows (NaN or -inf everywhere)
            for r, t in zip(samplers, tokens, strict=True):
                if t < 0 and r.finish is None:
                    self.fail(r, "sampling", ValueError("no finite logit in its row"))
        alive, alive_drawn = samplers, drawn
        if self.failures:
            keep = [i for i, r in enumerate(samplers) if r.finish is None]
            alive = [samplers[i] for i in keep]
            alive_drawn = drawn[torch.tensor(keep, dtype=torch.int64, device=drawn.device)]
        if alive:
            try:
                pen.on_sample(alive, alive_drawn)
            except Exception:  # on_sample writes nothing when it raises
                self._one_by_one(
                    "penalties", alive, lambda j: pen.on_sample(alive[j : j + 1], alive_drawn[j : j + 1])
                )
        if raw is not None:
            self._output_logprobs(
                raw, [samplers[i] for i in asked], drawn[torch.tensor(asked, device=drawn.device)]
            )
        if self.failures:
            return [t if r.finish is None else None for r, t in zip(samplers, tokens, strict=True)]
        return tokens

    def _draw(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        key = tuple(r.uid for r in reqs)
        if self._sampling is None or self._sampling[0] != key:  # rebuilt only when the batch changes
            info = SamplingInfo.build([r.sampling for r in reqs], self.vocab_size, logits.device)
            self._sampling = (key, info)
        return self.runner.sample(logits, self._sampling[1], [len(r.output) for r in reqs])

    def _output_logprobs(self, raw: torch.Tensor, reqs: list[Req], sampled: torch.Tensor) -> None:
        """raw [len(reqs), V]: the log-distribution each of `reqs` sampled from; ended requests skipped."""
        if self.failures:
            keep = [j for j, r in enumerate(reqs) if r.finish is None]
            idx = torch.tensor(keep, dtype=torch.int64, device=raw.device)
            reqs, raw, sampled = [reqs[j] for j in keep], raw[idx], sampled[idx]

        def append(a: int, b: int) -> None:  # appends only once every row was computed
            part = reqs[a:b]
            out = output_rows(
                raw[a:b], sampled[a:b], [r.lp.top_k for r in part], [r.lp.token_ids for r in part]
            )
            for r, row in zip(part, out, strict=True):
                r.lp_out.append(row)

        if reqs:
            try:
                append(0, len(reqs))
            except Exception:
                self._one_by_one("output logprobs", reqs, lambda j: append(j, j + 1))

    def _one_by_one(self, what: str, reqs: list[Req], one: Callable[[int], Any]) -> list[Any]:
        """After the batched `what` raised: run it for each request alone. A request whose own run
        raises is ended (abort, 500) and gets None."""
        log.exception("%s failed for a batch of %d requests; retrying them one by one", what, len(reqs))
        out = []
        for i, r in enumerate(reqs):
            if r.finish is not None:
                out.append(None)
                continue
            try:
                out.append(one(i))
            except Exception as e:
                log.exception("%s failed for request %s", what, r.rid)
                self.fail(r, what, e)
                out.append(None)
        return out

    def fail(self, req: Req, what: str, e: Exception) -> None:
        """End a request of this step alone; the scheduler's `_release_finished` reports it and frees
        its KV."""
        message = f"internal error in {what} for this request: {type(e).__name__}: {e}"
        req.finish = {"type": "abort", "message": message, "status_code": 500}
        req.lp_in, req.lp_out = [], []
        self.failures += 1
        self.stats["request_failures"] += 1
