"""The scheduler loop: admit -> pick the batch -> run -> process results. Synchronous; the service
around it does the bus I/O.

One step = every running request computes what it still lacks (decodes: one token; chunked prefills:
the next chunk) plus newly admitted requests, within `chunked_prefill_size` prefill tokens, all in one
mixed forward. When the KV pool runs short: evict unlocked cache leaves (LRU); if still short, retract
the most recently admitted request (its KV goes to the cache unlocked, it rejoins the queue and resumes
from its cached prefix later).

Failures stay with the request that caused them: what arrives is checked first (`check_request`: the
bus is a trust boundary), and logits -> tokens and logprobs (`SampleStep`, sample_step.py) ends only
the requests whose own row fails (abort, 500). Only an error that concerns the whole step (the
forward) fails the step (`fail_running`). Requests that follow a crash run alone (quarantine.py).

A step is launched (`_launch`: slots, ForwardBatch, forward, draw) and completed (`_complete`: the ids
on the host, finishes, output). With overlap scheduling the next step is launched before the previous
one completes, so its host work hides behind the device's (docs/architecture.md, "Overlap scheduling").

Batch statistics go to this module's logger at INFO, in SGLang's words (`BatchLog`, batch_log.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from services.scheduler.batch_log import BatchLog
from services.scheduler.cascade import CascadePlanner
from services.scheduler.constrained.admission import GrammarAdmission
from services.scheduler.constrained.grammar import GrammarError
from services.scheduler.constrained.jump_forward import GrammarDecode
from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.host_copy import to_device
from services.scheduler.intake import RequestIntake
from services.scheduler.model_runner import ModelRunner
from services.scheduler.policy import InBatchPrefixCheck, match_key, order_waiting
from services.scheduler.pool_state import PoolState
from services.scheduler.prefix_cache import make_prefix_cache
from services.scheduler.quarantine import CrashRecord, Quarantine
from services.scheduler.request import Req
from services.scheduler.sample_step import Drawn, SampleStep
from services.scheduler.step_inputs import StepInputs
from services.scheduler.step_output import StepOutput
from services.scheduler.step_timer import Marks, StepTimer
from shared.config import EngineConfig
from shared.finish import Abort, Length
from shared.messages import BatchTokenOut

log = logging.getLogger(__name__)

# after a retraction reserve this share of running requests' output budgets, decaying back per step
_RETRACT_RATIO = 1.0
_RATIO_DECAY = 0.002


@dataclass
class _Step:
    """A launched step: its batch, the requests that draw a token, their drawn ids (on their way to
    the host), and each prefilled request with its computed length after this step."""

    batch: list[Req]
    samplers: list[Req]
    drawn: Drawn | None
    prefilled: list[tuple[Req, int]]
    marks: Marks | None = None  # device timing (StepTimer, CUDA only)
    number: int = 0  # steps launched before it


class Scheduler(RequestIntake, PoolState):
    def __init__(self, config: EngineConfig, runner: ModelRunner, record: CrashRecord | None = None) -> None:
        self.cfg, self.runner = config, runner
        self.kv, self.req_to_token = runner.kv, runner.req_to_token
        self.tree = make_prefix_cache(config.disable_radix_cache, self.kv, self.req_to_token)
        self.context_len = runner.context_len
        self.chunk_size = runner.chunked_prefill_size
        self.max_running = runner.max_running_requests
        self.eos_ids = runner.model_config.eos_token_ids
        self.vocab_size = runner.model_config.vocab_size
        self.vision = runner.vision
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.held: dict[int, list[Req]] = {}
        self.quarantine = Quarantine(record)
        self.ratio = config.new_token_ratio
        self.output = StepOutput()
        # KV slots promised to this step's requests (`_extend`), taken from the pool in one go when
        # the step's batch is built; `_step_slots`: those of the step in flight, until it completes
        self._promised = 0
        self._step_slots: torch.Tensor | None = None
        self.overlap = runner.overlap_schedule
        self._inflight: _Step | None = None  # overlap scheduling: the launched step not yet completed
        # the in-batch prefix checks of this step's admission and of the step in flight
        self._step_check: InBatchPrefixCheck | None = None
        self._last_check: InBatchPrefixCheck | None = None
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "steps": 0,
                      "overlapped_steps": 0, "forward_s": 0.0, "step_s": 0.0, "retractions": 0,
                      "request_failures": 0, "cache_flushes": 0, "row_steps": 0}  # fmt: skip
        self.sampling = SampleStep(runner, self.req_to_token.table.shape[0], self.stats)
        self.timer = StepTimer(runner.device, self.stats)
        mc, on = runner.model_config, config.enable_cascade_attention and runner.attn.supports_cascade
        self.cascade = CascadePlanner(runner.device, mc.num_heads, mc.num_kv_heads) if on else None
        self.grammars = GrammarAdmission(config, runner)  # compiles off the step loop
        self.grammar_decode = GrammarDecode(self.kv, self.req_to_token, self.context_len, self.eos_ids,
                                            not config.disable_jump_forward, self.stats)  # fmt: skip
        self._log = BatchLog(log)

    # -- the loop -----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    def step(self, send_early: Callable[[BatchTokenOut], None] | None = None) -> BatchTokenOut | None:
        """Run one step; returns this step's output for the detokenizer, or None if nothing happened.

        Overlap scheduling: the step launched here runs on the GPU while the previous one's ids come
        back and are processed, so the host work of one step hides behind the device work of the
        next. Without it, a step is launched and completed at once.

        send_early (overlap only): ready output goes to it right after the launch, so its consumers
        run while this thread waits for the device; the completion's output waits for the next launch
        (returned only when nothing was launched). Why: docs/architecture.md, the offline Engine."""
        t0 = time.perf_counter()
        self.timer.lap_begin()
        self._release_finished()
        self._step_check = None
        batch, alone = self.quarantine.schedule(self, self._schedule, self._flush)
        self.timer.lap("schedule")
        # a constrained request decoding the token in flight: its mask needs that token, so the step
        # in flight is completed between this step's forward and its sampling
        defer = (
            self._inflight is not None
            and self.sampling.grammar_mask.active
            and any(r.pending and r.matcher is not None for r in batch)
        )
        launched = self._launch(batch, defer) if batch else None
        early = send_early is not None and self.overlap and launched is not None and alone is None
        if early and (ready := self.take_output()) is not None:
            send_early(ready)
        self.timer.lap("send")
        self._last_check = self._step_check if launched is not None and self.overlap else None
        if self.overlap and alone is None:
            done, self._inflight = self._inflight, launched
        else:  # an alone step completes at once: a fault in it surfaces within it
            done = launched
        if done is not None:
            self._complete(done)
        self.quarantine.ran(self, alone)
        self._release_finished()
        self.timer.lap("release")
        self.stats["step_s"] += time.perf_counter() - t0
        return None if early else self.take_output()

    def take_output(self) -> BatchTokenOut | None:
        """What was produced since the last call (steps, and requests rejected on arrival)."""
        return self.output.take()

    def _schedule(self) -> list[Req]:
        # running requests first: decodes cost one slot each, chunked prefills take from the budget;
        # retract the newest while even an emptied cache could not hold this step's tokens
        while True:
            plan, budget = self._plan_running(self.chunk_size)
            need = sum(n for _, n in plan)
            if need <= self.kv.free_count + self.tree.evictable_size() or len(self.running) <= 1:
                break
            if self._inflight is not None:  # retract only what is fully known: finish the step in flight
                self._flush()
                continue
            self._retract(self.running[-1])
        batch: list[Req] = []
        short = need - (self.kv.free_count - self._promised)
        if short > 0:  # one eviction for the whole step (per request, every step of a full pool paid one)
            self.tree.evict(short)
        if need <= self.kv.free_count - self._promised:  # the usual case: promise the slots at once
            self._promised += need
            for r, n in plan:
                r.extend_len = n
            batch = [r for r, n in plan if n]
            plan = []
        for r, n in plan:
            if n and self._extend(r, n):
                batch.append(r)
            elif n:  # a lone request that outgrew the whole pool
                message = f"KV pool ({self.kv.size} tokens) exhausted"
                r.finish = Abort(message, 503)
        self.ratio = max(self.cfg.new_token_ratio, self.ratio - _RATIO_DECAY)
        if self.waiting and budget > 0:
            batch += self._admit(budget)
        return batch

    def _plan_running(self, budget: int) -> tuple[list[tuple[Req, int]], int]:
        """Tokens each running request computes this step, and the prefill budget left for new ones."""
        plan = []
        ctx = self.context_len
        for r in self.running:
            known = len(r.prompt) + len(r.output)
            left = known + r.pending - r.num_computed
            if r.pending and (len(r.output) + 1 >= r.max_new_tokens or known + 1 >= ctx):
                plan.append((r, 0))  # its token in flight ends it by length: nothing more to compute
            elif left == 1:
                plan.append((r, 1))
            else:
                n = min(left, budget)
                budget -= n
                plan.append((r, n))
        return plan, budget

    def _admit(self, budget: int) -> list[Req]:
        admitted: list[Req] = []
        failed: list[Req] = []
        reserve = sum(self._reserve(r) for r in self.running)
        check = InBatchPrefixCheck()
        # under overlap the previous step's prefills are still in flight (not cached yet): wait for them too
        in_flight = self._last_check if self._inflight is not None else None
        self._step_check = check
        now = time.monotonic()
        for req in order_waiting(self.waiting, self.tree, self.cfg.schedule_policy, self.cfg.max_queue_wait):
            if budget <= 0 or len(self.running) >= self.max_running or self.req_to_token.free_count == 0:
                break
            if req.grammar is not None and not self._grammar_ready(req, now):
                if req.finish is not None:
                    failed.append(req)
                continue  # still compiling: the others go ahead
            match = self.tree.match_prefix(match_key(req))
            cached = len(match.indices)
            if (in_flight is not None and in_flight.covers(req, cached)) or check.hold_back(req, cached):
                continue
            self.tree.inc_lock_ref(match.last_node)
            n = min(req.fill_len - cached, budget)
            available = self.kv.free_count - self._promised + self.tree.evictable_size()
            if not self.running:  # alone it may take the whole pool, chunk by chunk
                n = min(n, available)
            # past max_queue_wait only this step's tokens must fit, not the reserve: a long output
            # cannot hold the queue for good (retraction handles a later shortage)
            held = 0 if now - req.arrival > self.cfg.max_queue_wait else reserve + self._reserve(req)
            if n <= 0 or (self.running and n + held > available):
                self.tree.dec_lock_ref(match.last_node)
                break
            req.row = self.req_to_token.alloc()
            self.req_to_token.write(req.row, 0, match.indices)
            req.last_node, req.num_cached, req.num_computed = match.last_node, cached, cached
            try:
                self.sampling.admit(req)
            except Exception as e:
                log.exception("sampling state for request %s failed", req.rid)
                self.tree.dec_lock_ref(match.last_node)
                self.req_to_token.free(req.row)
                req.row, req.last_node, req.num_cached, req.num_computed = None, None, 0, 0
                self._finish_now(req, f"internal error in sampling state for this request: {e!r}", 500)
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

    def _grammar_ready(self, req: Req, now: float) -> bool:
        try:
            if not self.grammars.ready(req, now):
                return False
            self.grammar_decode.start(req, self.grammars.retokenizer)
        except GrammarError as e:  # it does not compile, or took too long: a 400 for this request alone
            self._finish_now(req, str(e), e.status_code)
            return False
        if req.output and not req.announced:
            self.output.emit(req, req.output[:])
        return req.finish is None

    def _reserve(self, req: Req) -> int:
        """Slots kept for the rest of the request's output, which the context bounds."""
        return math.ceil(self.ratio * max(min(req.remaining_output, self.context_len - req.fill_len), 0))

    def _extend(self, req: Req, n: int) -> bool:
        """Promise `req` KV slots for its next n tokens, evicting cache leaves if needed; the slots
        are taken when the step's batch is built (`_forward_batch`: one allocation for all)."""
        short = n - (self.kv.free_count - self._promised)
        if short > 0 and self.tree.evict(short) < short:
            req.extend_len = 0
            return False
        self._promised += n
        req.extend_len = n
        return True

    def _retract(self, req: Req) -> None:
        self.sampling.release(req)
        self.tree.cache_finished(req)
        req.num_cached = req.num_computed = 0
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.ratio = _RETRACT_RATIO
        self.stats["retractions"] += 1

    # -- forward ------------------------------------------------------------------------------
    def _forward_batch(self, batch: list[Req], decodes: list[Req]) -> tuple[ForwardBatch, StepInputs]:
        step = StepInputs.collect(batch)
        self.timer.lap("inputs")
        loc = self.kv.alloc(self._promised)
        assert loc is not None and loc.numel() == step.num_tokens, "the step's slots were promised"
        self._promised, self._step_slots = 0, loc
        cascade = self.cascade.plan(decodes) if self.cascade else None
        mm = self.vision.rows(batch, self.runner) if self.vision else None  # images' rows, where due
        if cascade is None and mm is None and step.fits_rows(self.runner.rows_max_tokens):
            step.as_rows()
            self.stats["row_steps"] += 1
        self.timer.lap("slots")
        in_flight = None
        if step.from_flight:
            assert self._inflight is not None and self._inflight.drawn is not None
            in_flight = self._inflight.drawn.safe
        fb = step.forward_batch(loc, self.req_to_token.table, self.runner.device, cascade, in_flight)
        return (fb if mm is None else replace(fb, mm=mm)), step

    def _launch(self, batch: list[Req], defer: bool = False) -> _Step:
        """Run the batch's forward and draw its tokens, without waiting for them (overlap) or not.
        defer: complete the step in flight after the forward, then draw for the requests whose token
        is still the next one (not those it finished, or whose grammar jumped forward)."""
        # one-token requests first: an attention backend runs its decode kernel on those (num_decode)
        decodes = [r for r in batch if r.extend_len == 1]
        batch = decodes + [r for r in batch if r.extend_len != 1]
        fb, step = self._forward_batch(batch, decodes)
        samplers = step.samplers
        self.timer.lap("batch", fb.mode, fb.batch_size)
        t1 = time.perf_counter()
        start = self.timer.begin()
        out = self.runner.forward(fb)
        logits = out.logits
        if step.lp_reqs:
            self.sampling.input_logprobs(out.lp_hidden, step.lp_reqs)
        if step.readers:  # their rows follow the samplers'; they end this step without drawing
            self.sampling.next_token_logprobs(logits[len(samplers) :], step.readers)
            logits = logits[: len(samplers)]
        self.timer.lap("forward")
        number = self.stats["steps"]
        self.stats["steps"] += 1
        self.stats["overlapped_steps"] += self._inflight is not None  # launched while another runs
        # the step's KV is the requests' now: count it computed at launch, so the next step (under
        # overlap, scheduled before this one completes) plans from here
        prefilled = step.prompt_extends
        for r in batch:
            r.num_computed += r.extend_len
            r.extend_len = 0
        if defer:  # the masks fill while the step in flight completes (GrammarMaskProcessor.begin)
            done, self._inflight = self._inflight, None
            self.sampling.grammar_mask.begin(samplers)
            self._complete(done)
            keep = [j for j, r in enumerate(samplers) if r.finish is None and r.fill_len == r.num_computed]
            if len(keep) < len(samplers):
                logits, samplers = (
                    logits[to_device(keep, torch.int64, logits.device)],
                    [samplers[j] for j in keep],
                )
            if not samplers:
                self.sampling.grammar_mask.drop()
        drawn = self.sampling.launch(logits, samplers, sync=not self.overlap) if samplers else None
        marks = self.timer.end(start, fb.mode, fb.batch_size, fb.num_tokens)
        self.stats["forward_s"] += time.perf_counter() - t1
        self.timer.lap("sample")
        for j, r in enumerate(samplers):
            r.pending, r.pending_at, r.pending_step = 1, j, number
        self._step_slots = None
        return _Step(batch, samplers, drawn, prefilled, marks, number)

    def _flush(self) -> None:
        """Complete the step in flight now (before a retraction, which needs every token known)."""
        done, self._inflight = self._inflight, None
        if done is not None:
            self._complete(done)
            self._release_finished()

    def _complete(self, st: _Step) -> None:
        """The step's ids are on the host: append them, check finishes, emit. A request that finished,
        failed or was aborted since the launch drops its token."""
        tokens = self.sampling.finish(st.drawn) if st.drawn is not None else []
        self.timer.collect(st.marks)
        self.timer.lap("wait")
        generated = 0
        for r in st.samplers:
            if r.pending_step == st.number:  # else its token of the next step, launched already, waits
                r.pending = 0
        pairs = zip(st.samplers, tokens, strict=True)
        constrained = [(r, t) for r, t in pairs if r.matcher is not None and r.finish is None]
        starts = {}  # the constrained requests' matchers take their tokens and jump, batched
        if constrained:
            done = self.grammar_decode.advance_all(constrained, self.grammars.retokenizer)
            starts = {r.uid: s for (r, _), s in zip(constrained, done, strict=True)}
        for r, tok in zip(st.samplers, tokens, strict=True):
            if r.uid in starts:
                if (start := starts[r.uid]) is None:
                    continue  # the grammar refused it: aborted
                if r.finish is None and r.fill_len == r.num_computed:  # it draws next (no jump): its mask
                    self.sampling.grammar_mask.ready(r)
            elif r.finish is not None:
                continue
            else:
                r.output.append(tok)
                r.check_finished(tok, self.context_len)
                start = len(r.output) - 1
            self.output.emit(r, r.output[start:])
            generated += 1
        self.stats["generated_tokens"] += generated
        for r in st.batch:  # max_new_tokens == 0: finished once the prompt is in
            if r.finish is None and not r.pending and len(r.output) >= r.max_new_tokens and r.remaining == 0:
                r.finish = Length(len(r.output))
                self.output.emit(r, [])
        for r, n in st.prefilled:
            if r.finish is None:  # share the prefix with requests that arrive meanwhile; a jump-forward
                # retokenization above may have dropped KV past num_computed (freed: not to be cached)
                self.tree.cache_unfinished(r, min(n, r.num_computed))
        if len(st.prefilled) < len(st.batch):
            self._log.decode_step(self, generated)
        self.timer.lap("complete")

    def _release_finished(self) -> None:
        if any(r.finish for r in self.running):
            for r in [r for r in self.running if r.finish]:
                if isinstance(r.finish, Abort):
                    self.output.emit(r, [])
                self.sampling.release(r)
                known = len(r.prompt) + len(r.output)
                if r.num_computed > known:  # KV for a token it drops (in flight when it ended): free it
                    self.kv.free(self.req_to_token.table[r.row, known : r.num_computed].clone())
                    r.num_computed = known
                self.tree.cache_finished(r)
                self.running.remove(r)
                self.release_held(r)

    # -- output -------------------------------------------------------------------------------
    def fail_running(self, message: str) -> tuple[BatchTokenOut | None, list[str]]:
        """After a step raised: end the running requests (`Quarantine.step_failed`) and free their KV and
        the failed step's slots (never counted). Returns the output and the work tokens to give back."""
        if self._step_slots is not None:
            self.kv.free(self._step_slots)
        self._promised, self._step_slots, self._inflight = 0, None, None
        self.sampling.grammar_mask.drop()
        give_back = self.quarantine.step_failed(self, message)
        self._release_finished()
        return self.take_output(), give_back
