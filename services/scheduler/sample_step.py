"""From the forward's output to this step's tokens and logprobs, with failures kept to the request that
caused them.

The logits go through the logits processors (sampling/processors.py) in order, then the sampler
draws, then each processor sees the drawn tokens:

    LogprobCapture          the raw distribution, for output logprobs (first: before anything changes it)
    PenaltyProcessor        frequency / presence / repetition penalties (DensePenaltyProcessor on a GPU)
    LogitBiasProcessor      logit_bias
    MinNewTokensProcessor   EOS and stop ids masked until min_new_tokens

Every stage runs batched first. Only when a batched stage raises is it retried request by request
(`_one_by_one`), and only the requests whose own row fails are ended (abort, 500); `_release_finished`
in the scheduler reports them and frees their KV. The common step pays no per-request Python work for
this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.scheduler.host_copy import to_device
from services.scheduler.logprobs import input_rows, next_rows
from services.scheduler.model_runner import ModelRunner
from services.scheduler.request import Req
from services.scheduler.sampling.dense_penalties import DensePenaltyProcessor
from services.scheduler.sampling.grammar_mask import GrammarMaskProcessor
from services.scheduler.sampling.logit_bias import LogitBiasProcessor
from services.scheduler.sampling.logprob_capture import LogprobCapture
from services.scheduler.sampling.min_new_tokens import MinNewTokensProcessor
from services.scheduler.sampling.penalties import PenaltyProcessor
from services.scheduler.sampling.processors import LogitsProcessor
from services.scheduler.sampling.sampler import SamplingInfo
from shared.finish import Abort

log = logging.getLogger(__name__)


@dataclass
class Drawn:
    """A step's drawn ids on their way to the host: `ids` [B] on the device (-1: no usable logit),
    `safe` the same with -1 read as 0 (what the next step may feed the model before finish())."""

    samplers: list[Req]
    ids: torch.Tensor
    safe: torch.Tensor
    lp_rows: list[tuple[Req, Any]]  # output-logprob rows of this draw (LogprobCapture.take)
    _host: torch.Tensor
    _ready: torch.cuda.Event | None

    @classmethod
    def start(cls, samplers: list[Req], ids: torch.Tensor, safe: torch.Tensor, lp_rows: list) -> Drawn:
        if ids.device.type != "cuda":
            return cls(samplers, ids, safe, lp_rows, ids, None)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(samplers, ids, safe, lp_rows, host, ready)

    def host_ids(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class SampleStep:
    """The sampling stage of the scheduler's step; keeps the batch's SamplingInfo between steps."""

    def __init__(self, runner: ModelRunner, rows: int, stats: dict[str, Any]) -> None:
        self.runner, self.stats = runner, stats
        self.vocab_size = vocab = runner.model_config.vocab_size
        dev = runner.device
        # dense per-row state on a GPU (no per-request Python in a step); sparse pairs on a CPU
        self.penalties = (DensePenaltyProcessor if dev.type == "cuda" else PenaltyProcessor)(rows, vocab, dev)
        self.capture = LogprobCapture()
        self.grammar_mask = GrammarMaskProcessor(vocab, dev)
        self.processors: list[LogitsProcessor] = [
            self.capture,
            self.penalties,
            LogitBiasProcessor(dev),
            MinNewTokensProcessor(dev),
            self.grammar_mask,
        ]
        self._sampling: tuple[tuple[int, ...], SamplingInfo] | None = None

    def admit(self, req: Req) -> None:
        """A request got a row; raises when a processor cannot hold its state (the caller ends it)."""
        for p in self.processors:
            p.admit(req)

    def release(self, req: Req) -> None:
        for p in self.processors:
            p.release(req)

    def input_logprobs(self, lp_hidden: torch.Tensor | None, lp_reqs: list[tuple[Req, int]]) -> None:
        """Prompt logprobs for this step's positions of each of `lp_reqs` (request, count)."""
        assert lp_hidden is not None
        row = 0
        for r, m in lp_reqs:
            a = r.lp_pos
            targets = r.prompt[a + 1 : a + 1 + m]
            hidden = lp_hidden[row : row + m]
            try:
                r.lp_in += input_rows(hidden, self.runner.logits, targets, r.lp.top_k, r.lp.token_ids)
                r.lp_pos += m
            except Exception as e:
                log.exception("prompt logprobs failed for request %s", r.rid)
                self.fail(r, "prompt logprobs", e)
            row += m

    def next_token_logprobs(self, logits: torch.Tensor, readers: list[Req]) -> None:
        """The requests that end at their prompt and asked for its next-token logprobs
        (`Req.reads_next_logprobs`): their rows of `logits` [len(readers), V], raw as every output
        logprob, join `lp_out` now (they finish when this step completes; nothing is drawn)."""

        def rows(i: int, j: int) -> list[Any]:
            lp = torch.log_softmax(logits[i:j].float(), dim=-1)
            part = readers[i:j]
            return next_rows(lp, [r.lp.top_k for r in part], [r.lp.token_ids for r in part])

        try:
            got = rows(0, len(readers))
        except Exception:
            alone = self._one_by_one("next-token logprobs", readers, lambda i: rows(i, i + 1))
            got = [None if one is None else one[0] for one in alone]
        for r, row in zip(readers, got, strict=True):
            if row is not None and r.finish is None:
                r.lp_out.append(row)

    def launch(self, logits: torch.Tensor, samplers: list[Req], sync: bool = True) -> Drawn:
        """Processors, draw, processors' on_sample; the ids start their way to the host. With
        sync=False nothing here waits for the GPU (unless a processor must: output logprobs, the CPU
        penalties), so the caller can prepare the next step meanwhile. A batched stage that raises is
        retried request by request (`_one_by_one`); a request whose own row fails is ended."""
        dev = logits.device
        if logits.dtype != torch.float32 and any(p.active for p in self.processors):
            logits = logits.float()  # the processors work in float32 (the model's logits may be bf16)
        # each row's output index: a token still in flight (overlap scheduling) counts
        lens = to_device([len(r.output) + r.pending for r in samplers], torch.int64, dev).unsqueeze(1)
        for p in self.processors:
            try:
                p.apply(logits, samplers, lens)
            except Exception:  # apply writes nothing when it raises, so no row is changed twice
                self._one_by_one(
                    p.name,
                    samplers,
                    lambda i, p=p: p.apply(logits[i : i + 1], samplers[i : i + 1], lens[i : i + 1]),
                )
        try:
            drawn = self._draw(logits, samplers, lens, sync)
        except Exception:
            rows = self._one_by_one(
                "sampling",
                samplers,
                lambda i: self._draw(logits[i : i + 1], samplers[i : i + 1], lens[i : i + 1], sync),
            )
            none = torch.tensor([-1], device=dev)
            drawn = torch.cat([none if t is None else t for t in rows])
        safe = drawn.clamp(min=0)  # a dead row (-1) is ended in finish(); meanwhile it reads token 0
        alive = [i for i, r in enumerate(samplers) if r.finish is None]
        if alive:
            live = samplers if len(alive) == len(samplers) else [samplers[i] for i in alive]
            live_drawn = safe if len(alive) == len(samplers) else safe[to_device(alive, torch.int64, dev)]
            for p in self.processors:
                try:
                    p.on_sample(live, live_drawn)
                except Exception:  # on_sample writes nothing when it raises
                    self._one_by_one(
                        p.name, live, lambda j, p=p: p.on_sample(live[j : j + 1], live_drawn[j : j + 1])
                    )
        return Drawn.start(samplers, drawn, safe, self.capture.take())

    def finish(self, drawn: Drawn) -> list[int]:
        """The drawn ids on the host (the step's one wait for the GPU); a request whose row had no
        usable logit is ended here."""
        tokens = drawn.host_ids()
        if tokens and min(tokens) < 0:  # the sampler found no usable logit in these rows
            for r, t in zip(drawn.samplers, tokens, strict=True):
                if t < 0 and r.finish is None:
                    self.fail(r, "sampling", ValueError("no finite logit in its row"))
        for r, row in drawn.lp_rows:
            if r.finish is None:
                r.lp_out.append(row)
        return tokens

    def _draw(self, logits: torch.Tensor, reqs: list[Req], lens: torch.Tensor, sync: bool) -> torch.Tensor:
        key = tuple(r.uid for r in reqs)
        if self._sampling is None or self._sampling[0] != key:  # rebuilt only when the batch changes
            info = SamplingInfo.build([r.sampling for r in reqs], self.vocab_size, logits.device)
            self._sampling = (key, info)
        return self.runner.sample(logits, self._sampling[1], lens, check=sync)

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
        req.finish = Abort(message, 500)
        req.lp_in, req.lp_out = [], []
        self.stats["request_failures"] += 1


def _row(i: int, logits: torch.Tensor, reqs: list[Req], lens: torch.Tensor) -> tuple:
    """Request i's slice of a step, for a retry request by request."""
    return logits[i : i + 1], reqs[i : i + 1], lens[i : i + 1]
