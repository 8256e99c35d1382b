"""The scheduler loop: admit -> pick the batch -> run -> process results. Synchronous; the service
around it does the bus I/O.

One step = every running request computes what it still lacks (decodes: one token; chunked prefills:
the next chunk) plus newly admitted requests, within `chunked_prefill_size` prefill tokens, all in one
mixed forward. When the KV pool runs short: evict unlocked cache leaves (LRU); if still short, retract
the most recently admitted request (its KV goes to the cache unlocked, it rejoins the queue and resumes
from its cached prefix later).

Failures stay with the request that caused them: what arrives is checked first (`check_request`: the
bus is a trust boundary), and a batched penalty, sampling or logprob operation that raises is retried
request by request, ending only the requests whose own row fails (abort, 500). Only an error that
concerns the whole step (the forward) fails the step (`fail_running`).

Batch statistics go to this module's logger at INFO, in SGLang's words: a "Decode batch." line every
`DECODE_LOG_INTERVAL` decode steps, a "Prefill batch." line when requests were admitted (at most one
per `PREFILL_LOG_INTERVAL_S`, with the counts since the last one).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.logprobs import input_rows, output_rows, pack
from services.scheduler.model_runner import ModelRunner
from services.scheduler.policy import InBatchPrefixCheck, match_key, order_waiting
from services.scheduler.radix_cache import RadixCache
from services.scheduler.request import Req, check_request
from services.scheduler.sampling.penalties import Penalizer
from services.scheduler.sampling.sampler import SamplingInfo
from shared.config import EngineConfig
from shared.messages import BatchTokenOut, GenerateReq, NewReqInfo
from shared.sampling_params import SamplingParams
from shared.transport import Work

log = logging.getLogger(__name__)

# after a retraction reserve this share of running requests' output budgets, decaying back per step
_RETRACT_RATIO = 1.0
_RATIO_DECAY = 0.002
DECODE_LOG_INTERVAL = 40  # decode steps between two "Decode batch." lines (SGLang's default)
PREFILL_LOG_INTERVAL_S = 1.0  # at most one "Prefill batch." line this often; the counts add up between


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.cfg, self.runner = config, runner
        self.kv, self.req_to_token = runner.kv, runner.req_to_token
        self.tree = RadixCache(self.kv.free, disable=config.disable_radix_cache)
        self.context_len = runner.context_len
        self.max_running = runner.max_running_requests
        self.eos_ids = runner.model_config.eos_token_ids
        self.vocab_size = runner.model_config.vocab_size
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.ratio = config.new_token_ratio
        self._out = BatchTokenOut()
        self._sampling: tuple[tuple[int, ...], SamplingInfo] | None = None
        self.penalizer = Penalizer(self.req_to_token.table.shape[0], self.vocab_size, runner.device)
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "steps": 0,
                      "forward_s": 0.0, "step_s": 0.0, "retractions": 0, "request_failures": 0}  # fmt: skip
        self._failures = 0  # requests ended by a failure of their own in the current step
        self._log = BatchLog()

    # -- inputs -------------------------------------------------------------------------------
    def add_request(self, msg: GenerateReq, work: Work | None = None) -> None:
        """Queue a request, or answer it at once with a 400 that names what is wrong with it. `work`:
        the work-queue delivery it came in (None in-process)."""
        if work is not None and work.deliveries > 1:
            live = next((r for r in (*self.waiting, *self.running) if r.rid == msg.rid), None)
            if live is not None:  # delivered again while it runs here (a late keep-alive): keep going
                live.work_token = work.token
                return
        try:
            problem = check_request(msg, self.vocab_size, self.context_len, self.kv.size)
            req = Req(msg, self.eos_ids, self.context_len)
        except Exception as e:  # values of the wrong type: only a struct built in-process can have them
            problem = f"invalid request: {type(e).__name__}: {e}"
            blank = GenerateReq(
                rid=msg.rid, input_ids=[], sampling=SamplingParams(), out_subject=msg.out_subject
            )
            req = Req(blank, self.eos_ids)
        if work is not None:
            req.work_token, req.attempt = work.token, work.deliveries
        if problem is None:
            self.waiting.append(req)
        else:
            self._finish_now(req, problem)

    def reject(self, msg: GenerateReq, message: str, status_code: int, work: Work | None = None) -> None:
        """Answer a request at once with an error, without running it."""
        blank = GenerateReq(rid=msg.rid, input_ids=[], sampling=SamplingParams(), out_subject=msg.out_subject)
        req = Req(blank, self.eos_ids)
        if work is not None:
            req.work_token, req.attempt = work.token, work.deliveries
        self._finish_now(req, message, status_code)

    def drop(self, rids: Iterable[str]) -> list[str]:
        """Release requests without a word to anyone (their output was lost on the bus, or their
        gateway is gone); returns their work tokens, for the caller to give back or end."""
        wanted, tokens = set(rids), []
        for req in [r for r in self.waiting if r.rid in wanted]:
            self.waiting.remove(req)
            tokens.append(req.work_token)
        for req in self.running:
            if req.rid in wanted and req.finish is None:
                req.finish = {"type": "dropped"}  # not an abort: _release_finished sends nothing
                tokens.append(req.work_token)
        return [t for t in tokens if t]

    def abort(self, rids: Iterable[str], finish: dict[str, Any] | None = None) -> None:
        """Abort requests (finish=None) or finish them with a reason found elsewhere (a stop string the
        detokenizer matched: it already told its client, so nothing more is sent)."""
        wanted = set(rids)
        for req in [r for r in self.waiting if r.rid in wanted]:
            self.waiting.remove(req)
            if finish is None:
                req.finish = {"type": "abort", "message": "aborted"}
                self._emit(req, [])
        for req in self.running:
            if req.rid in wanted and req.finish is None:
                req.finish = finish or {"type": "abort", "message": "aborted"}

    def _finish_now(self, req: Req, message: str, status_code: int = 400) -> None:
        req.finish = {"type": "abort", "message": message, "status_code": status_code}
        self._emit(req, [])

    # -- the loop -----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> BatchTokenOut | None:
        """Run one step; returns this step's output for the detokenizer, or None if nothing happened."""
        t0 = time.perf_counter()
        self._failures = 0
        self._release_finished()
        batch = self._schedule()
        if batch:
            fb, samplers, lp_reqs = self._forward_batch(batch)
            t1 = time.perf_counter()
            logits = self.runner.forward(fb)
            if lp_reqs:
                self._input_logprobs(fb, lp_reqs)
            tokens = self._sample(logits, samplers) if samplers else []
            self.stats["forward_s"] += time.perf_counter() - t1
            self._process(batch, samplers, tokens)
            self.stats["steps"] += 1
        self._release_finished()
        self.stats["step_s"] += time.perf_counter() - t0
        return self.take_output()

    def take_output(self) -> BatchTokenOut | None:
        """What was produced since the last call (steps, and requests rejected on arrival)."""
        out, self._out = self._out, BatchTokenOut()
        return out if out.rids else None

    def _schedule(self) -> list[Req]:
        # running requests first: decodes cost one slot each, chunked prefills take from the budget;
        # retract the newest while even an emptied cache could not hold this step's tokens
        while True:
            plan, budget = self._plan_running(self.cfg.chunked_prefill_size)
            need = sum(n for _, n in plan)
            if need <= self.kv.free_count + self.tree.evictable_size() or len(self.running) <= 1:
                break
            self._retract(self.running[-1])
        batch: list[Req] = []
        for r, n in plan:
            if n and self._extend(r, n):
                batch.append(r)
            elif n:  # a lone request that outgrew the whole pool
                message = f"KV pool ({self.kv.size} tokens) exhausted"
                r.finish = {"type": "abort", "message": message, "status_code": 503}
        self.ratio = max(self.cfg.new_token_ratio, self.ratio - _RATIO_DECAY)
        if self.waiting and budget > 0:
            batch += self._admit(budget)
        return batch

    def _plan_running(self, budget: int) -> tuple[list[tuple[Req, int]], int]:
        """Tokens each running request computes this step, and the prefill budget left for new ones."""
        plan = []
        for r in self.running:
            n = 1 if r.remaining == 1 else min(r.remaining, budget)
            if r.remaining > 1:
                budget -= n
            plan.append((r, n))
        return plan, budget

    def _admit(self, budget: int) -> list[Req]:
        admitted: list[Req] = []
        failed: list[Req] = []
        reserve = sum(self._reserve(r) for r in self.running)
        check = InBatchPrefixCheck()
        now = time.monotonic()
        for req in order_waiting(self.waiting, self.tree, self.cfg.schedule_policy, self.cfg.max_queue_wait):
            if budget <= 0 or len(self.running) >= self.max_running or self.req_to_token.free_count == 0:
                break
            match = self.tree.match_prefix(match_key(req))
            cached = len(match.indices)
            if check.hold_back(req, cached):
                continue
            self.tree.inc_lock_ref(match.last_node)
            n = min(req.fill_len - cached, budget)
            available = self.kv.free_count + self.tree.evictable_size()
            if not self.running:  # alone it may take the whole pool, chunk by chunk
                n = min(n, available)
            # past max_queue_wait only this step's tokens must fit, not the reserve: a long output
            # cannot hold the queue for good (retraction handles a later shortage)
            held = 0 if now - req.arrival > self.cfg.max_queue_wait else reserve + self._reserve(req)
            if n <= 0 or (self.running and n + held > available):
                self.tree.dec_lock_ref(match.last_node)
                break
            req.row = self.req_to_token.alloc()
            self.req_to_token.table[req.row, :cached] = match.indices
            req.last_node, req.num_cached, req.num_computed = match.last_node, cached, cached
            try:
                self.penalizer.on_admit(req)
            except Exception as e:
                log.exception("penalty state for request %s failed", req.rid)
                self.tree.dec_lock_ref(match.last_node)
                self.req_to_token.free(req.row)
                req.row, req.last_node, req.num_cached, req.num_computed = None, None, 0, 0
                self._finish_now(req, f"internal error in penalties for this request: {e!r}", 500)
                failed.append(req)
                continue
            if req.cached_tokens is None:
                req.cached_tokens = min(cached, len(req.prompt))
                self.stats["prompt_tokens"] += len(req.prompt)
                self.stats["cached_tokens"] += req.cached_tokens
            ok = self._extend(req, n)
            assert ok, "admission checked the pool"
            self.running.append(req)
            admitted.append(req)
            self._log.admitted(n, cached)
            budget -= n
            reserve += self._reserve(req)
        if admitted or failed:
            gone = {id(r) for r in admitted + failed}
            self.waiting = [r for r in self.waiting if id(r) not in gone]
        if admitted:
            self._log.prefill(self, len(admitted))
        return admitted

    def _reserve(self, req: Req) -> int:
        """Slots kept for the rest of the request's output, which the context bounds."""
        return math.ceil(self.ratio * max(min(req.remaining_output, self.context_len - req.fill_len), 0))

    def _extend(self, req: Req, n: int) -> bool:
        """Give `req` KV slots for its next n tokens, evicting cache leaves if needed."""
        slots = self.kv.alloc(n)
        if slots is None:
            self.tree.evict(n - self.kv.free_count)
            slots = self.kv.alloc(n)
            if slots is None:
                req.extend_len = 0
                return False
        self.req_to_token.table[req.row, req.num_computed : req.num_computed + n] = slots
        req.extend_len = n
        return True

    def _retract(self, req: Req) -> None:
        self._cache(req, finished=True)
        req.num_cached = req.num_computed = 0
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.ratio = _RETRACT_RATIO
        self.stats["retractions"] += 1

    # -- forward ------------------------------------------------------------------------------
    def _forward_batch(self, batch: list[Req]) -> tuple[ForwardBatch, list[Req], list[tuple[Req, int]]]:
        ids: list[int] = []
        samplers: list[Req] = []
        logits_idx: list[int] = []
        lp_idx: list[int] = []
        lp_reqs: list[tuple[Req, int]] = []  # requests owing prompt logprobs, positions this step
        start = 0
        for r in batch:
            c, n = r.num_computed, r.extend_len
            if n == 1:
                ids.append(r.prompt[c] if c < len(r.prompt) else r.output[c - len(r.prompt)])
            else:
                ids.extend(r.fill[c : c + n])
            if r.lp_pos < r.lp_end:  # the cache match stopped at lp_pos, so c <= lp_pos
                a, b = r.lp_pos, min(r.lp_end, c + n)
                if b > a:
                    lp_idx.extend(range(start + a - c, start + b - c))
                    lp_reqs.append((r, b - a))
            start += n
            if c + n == r.fill_len and r.remaining_output > 0:
                samplers.append(r)
                logits_idx.append(start - 1)
        dev = self.runner.device
        ext = torch.tensor([r.extend_len for r in batch])
        pre = torch.tensor([r.num_computed for r in batch])
        rows = torch.tensor([r.row for r in batch])
        firsts = torch.cumsum(ext, 0) - ext
        positions = torch.arange(start) - torch.repeat_interleave(firsts - pre, ext)
        loc = self.req_to_token.table[torch.repeat_interleave(rows.to(dev), ext.to(dev)), positions.to(dev)]
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            out_cache_loc=loc,
            rows=rows.to(dev),
            prefix_lens=pre.tolist(),
            extend_lens=ext.tolist(),
            logits_idx=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            lp_idx=torch.tensor(lp_idx, dtype=torch.int64, device=dev) if lp_idx else None,
        )
        return fb, samplers, lp_reqs

    def _input_logprobs(self, fb: ForwardBatch, lp_reqs: list[tuple[Req, int]]) -> None:
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
                self._fail_request(r, "prompt logprobs", e)
            row += m
        fb.lp_hidden = None

    def _sample(self, logits: torch.Tensor, samplers: list[Req]) -> list[int | None]:
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
                    self._fail_request(r, "sampling", ValueError("no finite logit in its row"))
        alive, alive_drawn = samplers, drawn
        if self._failures:
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
        if self._failures:
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
        if self._failures:
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
                self._fail_request(r, what, e)
                out.append(None)
        return out

    def _fail_request(self, req: Req, what: str, e: Exception) -> None:
        """End a request of this step alone; `_release_finished` reports it and frees its KV."""
        message = f"internal error in {what} for this request: {type(e).__name__}: {e}"
        req.finish = {"type": "abort", "message": message, "status_code": 500}
        req.lp_in, req.lp_out = [], []
        self._failures += 1
        self.stats["request_failures"] += 1

    def _process(self, batch: list[Req], samplers: list[Req], tokens: list[int | None]) -> None:
        prefilled = [r for r in batch if r.extend_len > 1]
        for r in batch:
            r.num_computed += r.extend_len
            r.extend_len = 0
        generated = 0
        for r, tok in zip(samplers, tokens, strict=True):
            if tok is None:  # failed in this step; _release_finished reports it
                continue
            r.output.append(tok)
            r.check_finished(tok, self.context_len)
            self._emit(r, [tok])
            generated += 1
        self.stats["generated_tokens"] += generated
        for r in batch:
            if r.finish is None and r.remaining == 0 and r.remaining_output <= 0:  # max_new_tokens == 0
                r.finish = {"type": "length", "length": len(r.output)}
                self._emit(r, [])
        for r in prefilled:
            if r.finish is None:
                self._cache(r, finished=False)  # share the prefix with requests that arrive meanwhile
        if len(prefilled) < len(batch):
            self._log.decode_step(self, generated)

    def _release_finished(self) -> None:
        if any(r.finish for r in self.running):
            for r in [r for r in self.running if r.finish]:
                if r.finish.get("type") == "abort":
                    self._emit(r, [])
                self._cache(r, finished=True)
                self.running.remove(r)

    # -- cache bookkeeping --------------------------------------------------------------------
    def _cache(self, req: Req, finished: bool) -> None:
        """Hand the request's computed KV to the radix cache. Unfinished: keep it locked and point the
        request at the cached copy. Finished: unlock and give back the row."""
        n, row = req.num_computed, req.row
        slots = self.req_to_token.table[row, :n].clone()
        if self.tree.disable:
            if finished:
                self.kv.free(slots[req.num_cached :])
        else:
            key = req.fill[:n]
            prefix = self.tree.insert(key, slots)
            self.kv.free(slots[req.num_cached : prefix])  # our duplicates of what another request cached
            if not finished:
                match = self.tree.match_prefix(key)
                self.req_to_token.table[row, :n] = match.indices
                self.tree.inc_lock_ref(match.last_node)
                self.tree.dec_lock_ref(req.last_node)
                req.last_node, req.num_cached = match.last_node, n
        if finished:
            self.tree.dec_lock_ref(req.last_node)
            self.req_to_token.free(row)
            req.row, req.last_node = None, None

    # -- output -------------------------------------------------------------------------------
    def _emit(self, req: Req, tokens: list[int]) -> None:
        out = self._out
        if not req.announced:
            s = req.sampling
            out.new_reqs.append(
                NewReqInfo(
                    rid=req.rid,
                    out_subject=req.out_subject,
                    prompt_tokens=len(req.prompt),
                    stop=s.stop,
                    skip_special_tokens=s.skip_special_tokens,
                    spaces_between_special_tokens=s.spaces_between_special_tokens,
                    no_stop_trim=s.no_stop_trim,
                    created=req.created,
                    attempt=req.attempt,
                    work_token=req.work_token,
                )  # fmt: skip
            )
            req.announced = True
        out.rids.append(req.rid)
        out.token_ids.append(tokens)
        out.cached_tokens.append(req.cached_tokens or 0)
        out.offsets.append(len(req.output) - len(tokens))
        out.finish_reasons.append(req.finish)
        if req.lp is not None or out.logprobs:
            out.logprobs += [None] * (len(out.rids) - 1 - len(out.logprobs))
            lp = None
            if req.lp is not None:
                lp = pack(req.lp_in, req.lp_out)
                req.lp_in, req.lp_out = [], []
            out.logprobs.append(lp)

    def fail_running(self, message: str) -> BatchTokenOut | None:
        """After a step raised: abort every running request with a reason and give back its KV, so
        the server keeps serving. Slots taken for the failed step were never counted; free them."""
        for r in self.running:
            if r.extend_len:
                c = r.num_computed
                self.kv.free(self.req_to_token.table[r.row, c : c + r.extend_len].clone())
                r.extend_len = 0
            r.finish = r.finish or {"type": "abort", "message": message, "status_code": 500}
        self._release_finished()
        return self.take_output()

    def known_rids(self, rids: Iterable[str]) -> list[str]:
        """Which of these requests this scheduler is waiting on or running."""
        wanted = set(rids)
        return [r.rid for r in (*self.waiting, *self.running) if r.rid in wanted]

    # -- maintenance --------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        if self.has_work:
            return False
        self.tree.reset()
        return True

    def used_tokens(self) -> int:
        """KV slots held by running requests or locked in the cache (what cannot be evicted)."""
        return self.kv.size - self.kv.free_count - self.tree.evictable_size()

    def check_integrity(self) -> None:
        """free + cached + in use == pool size; raises AssertionError on a leak."""
        in_use = sum(r.num_computed - r.num_cached for r in self.running)
        free, cached = self.kv.free_count, self.tree.total_size()
        if free + cached + in_use != self.kv.size:
            raise AssertionError(
                f"KV leak: free {free} + cached {cached} + in use {in_use} != pool {self.kv.size}"
            )
        if not self.running:
            slots = torch.cat((self.kv.free_slots(), self.tree.all_slots()))
            if slots.unique().numel() != self.kv.size:
                raise AssertionError("KV slots duplicated between the free list and the cache")


class BatchLog:
    """SGLang's batch statistics lines, on the scheduler's logger; counting costs a few additions."""

    def __init__(self) -> None:
        self.new_seqs = self.new_tokens = self.cached_tokens = 0
        self.last_prefill = -math.inf
        self.decode_steps = self.decode_tokens = 0
        self.last_decode = time.perf_counter()

    def admitted(self, new_tokens: int, cached: int) -> None:
        self.new_seqs += 1
        self.new_tokens += new_tokens
        self.cached_tokens += cached

    def prefill(self, sched: Scheduler, just_admitted: int) -> None:
        now = time.monotonic()
        if now - self.last_prefill < PREFILL_LOG_INTERVAL_S:
            return
        if log.isEnabledFor(logging.INFO):
            log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d",
                self.new_seqs, self.new_tokens, self.cached_tokens, sched.used_tokens() / sched.kv.size,
                len(sched.running) - just_admitted, len(sched.waiting),
            )  # fmt: skip
        self.new_seqs = self.new_tokens = self.cached_tokens = 0
        self.last_prefill = now

    def decode_step(self, sched: Scheduler, generated: int) -> None:
        self.decode_steps += 1
        self.decode_tokens += generated
        if self.decode_steps % DECODE_LOG_INTERVAL:
            return
        now = time.perf_counter()
        if log.isEnabledFor(logging.INFO):
            used = sched.used_tokens()
            log.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "gen throughput (token/s): %.2f, #queue-req: %d",
                len(sched.running), used, used / sched.kv.size,
                self.decode_tokens / max(now - self.last_decode, 1e-9), len(sched.waiting),
            )  # fmt: skip
        self.decode_tokens = 0
        self.last_decode = now
