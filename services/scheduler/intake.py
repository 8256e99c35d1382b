"""What arrives at a scheduler besides its steps: new requests (checked first: a bad one is answered
with a 400 at once and never runs), rejections, aborts and drops. `Scheduler` takes these methods;
they touch only its queues (`waiting`, `running`, `held`) and its step output.

A request may bring others that run after it on this worker (`GenerateReq.then`: the n > 1 samples
after the prefill that leaves their prompt in the prefix cache). They wait in `held` until it ended,
then queue (or share its abort); they are one work-queue delivery with it, so they are dropped,
restarted and delivered again together."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.scheduler.request import DROPPED, Req, check_request
from shared.finish import Abort, FinishReason
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams
from shared.transport import Work

if TYPE_CHECKING:
    from services.scheduler.images import Vision
    from services.scheduler.memory import KVPool
    from services.scheduler.quarantine import Quarantine
    from services.scheduler.step_output import StepOutput
    from shared.config import EngineConfig

log = logging.getLogger(__name__)


class RequestIntake:
    waiting: list[Req]
    running: list[Req]
    output: StepOutput
    kv: KVPool
    vocab_size: int
    context_len: int
    vision: Vision | None  # a vision-language model's (images.py)
    eos_ids: tuple[int, ...]
    cfg: EngineConfig
    held: dict[int, list[Req]]  # a request's uid -> the requests that run after it (GenerateReq.then)
    quarantine: Quarantine  # requests that follow a crash run alone

    def add_request(self, msg: GenerateReq, work: Work | None = None, new_tokens: int | None = None) -> None:
        """Queue a request (and hold those that run after it), or answer it at once with a 400 that
        names what is wrong with it. `work`: the work-queue delivery it came in (None in-process).
        A delivery that follows a crash runs in quarantine (quarantine.py), or ends with a 500 when
        it crashed schedulers too often. (One that runs here was delivered again only because a
        keep-alive came late, on a busy machine: it keeps going.)
        `new_tokens`: the prompt tokens it will compute, as estimated on arrival (the load report).
        Past `max_queued_requests` waiting requests a new one is refused with a 503."""
        trial = None
        if work is not None and (work.deliveries > 1 or msg.attempt_base > 0):
            rids = {msg.rid, *(m.rid for m in msg.then)}
            live = [r for r in self._all() if r.rid in rids]
            if live:  # delivered again while it runs here (a late keep-alive): keep going
                for r in live:
                    r.work_token = work.token
                return
            trial = self.quarantine.judge(msg, work.deliveries)
            if trial is not None and trial.refuse is not None:
                log.error("%s: %s", msg.rid, trial.refuse)
                self.reject(msg, trial.refuse, 500, work)
                return
        bound = self.cfg.max_queued_requests
        if bound is not None and len(self.waiting) >= bound:
            why = (f"the scheduler's queue is full ({bound} requests waiting, max_queued_requests); "
                   "retry later")  # fmt: skip
            self.reject(msg, why, 503, work)
            return
        req = self._checked(msg, work)
        if new_tokens is not None:
            req.queued_tokens = new_tokens
        if isinstance(req.finish, Abort):  # refused: so are those that would run after it
            for m in msg.then:
                self._finish_now(self._blank(m, work), req.finish.message, req.finish.status_code or 400)
            return
        self.waiting.append(req)
        if msg.then:
            self.held[req.uid] = [r for r in (self._checked(m, work) for m in msg.then) if r.finish is None]
        if trial is not None:
            self.quarantine.watch(trial, [req, *self.held.get(req.uid, ())])

    def _checked(self, msg: GenerateReq, work: Work | None) -> Req:
        """The request to queue, or refused: answered at once, its finish set."""
        try:
            problem = check_request(msg, self.vocab_size, self.context_len, self.kv.size, self.vision)
            req = Req(msg, self.eos_ids, self.context_len)
        except Exception as e:  # values of the wrong type: only a struct built in-process can have them
            problem = f"invalid request: {type(e).__name__}: {e}"
            req = self._blank(msg, None)
        if work is not None:
            req.work_token, req.attempt = work.token, msg.attempt_base + work.deliveries
        if problem is not None:
            self._finish_now(req, problem)
        return req

    def _all(self) -> list[Req]:
        return [*self.waiting, *self.running, *(r for group in self.held.values() for r in group)]

    def release_held(self, req: Req) -> None:
        """`req` ended: those held for it queue now (its prompt is in the prefix cache), or end as it
        did when it was aborted or dropped."""
        group = self.held.pop(req.uid, None)
        if not group:
            return
        if isinstance(req.finish, Abort):
            for r in group:
                r.finish = req.finish
                self.output.emit(r, [])
        elif req.finish is not DROPPED:
            self.waiting.extend(group)

    def reject(self, msg: GenerateReq, message: str, status_code: int, work: Work | None = None) -> None:
        """Answer a request (and those that would run after it) at once with an error, without running it."""
        for m in (msg, *msg.then):
            self._finish_now(self._blank(m, work), message, status_code)

    def known_rids(self, rids: Iterable[str]) -> list[str]:
        """Which of these requests this scheduler is waiting on or running."""
        wanted = set(rids)
        return [r.rid for r in self._all() if r.rid in wanted]

    def drop(self, rids: Iterable[str]) -> list[str]:
        """Release requests without a word to anyone (their output was lost on the bus, or their
        gateway is gone), with every request of their deliveries (an n > 1 group goes back whole);
        returns those work tokens, once each, for the caller to give back or end."""
        wanted = set(rids)
        tokens = {r.work_token for r in self._all() if r.rid in wanted and r.work_token}
        doomed = {id(r) for r in self._all() if r.rid in wanted or (r.work_token and r.work_token in tokens)}
        for req in [r for r in self.waiting if id(r) in doomed]:
            self.waiting.remove(req)
            self.held.pop(req.uid, None)
        for req in self.running:
            if id(req) in doomed and req.finish is None:
                req.finish = DROPPED  # not an abort: _release_finished sends nothing
        for uid, group in list(self.held.items()):
            self.held[uid] = [r for r in group if id(r) not in doomed]
        return sorted(tokens)

    def abort(self, rids: Iterable[str], finish: FinishReason | None = None) -> None:
        """Abort requests (finish=None) or finish them with a reason found elsewhere (a stop string the
        detokenizer matched: it already told its client, so nothing more is sent)."""
        wanted = set(rids)
        for group in self.held.values():
            for req in [r for r in group if r.rid in wanted]:
                group.remove(req)
                if finish is None:
                    req.finish = Abort("aborted")
                    self.output.emit(req, [])
        for req in [r for r in self.waiting if r.rid in wanted]:
            self.waiting.remove(req)
            if finish is None:
                req.finish = Abort("aborted")
                self.output.emit(req, [])
                self.release_held(req)
            else:
                self.held.pop(req.uid, None)
        for req in self.running:
            if req.rid in wanted and req.finish is None:
                req.finish = finish or Abort("aborted")

    def _finish_now(self, req: Req, message: str, status_code: int = 400) -> None:
        req.finish = Abort(message, status_code)
        self.output.emit(req, [])

    def _blank(self, msg: GenerateReq, work: Work | None) -> Req:
        """A request to answer, not to run: msg's rid and subject only (its own fields may be unusable)."""
        blank = GenerateReq(rid=msg.rid, input_ids=[], sampling=SamplingParams(), out_subject=msg.out_subject)
        req = Req(blank, self.eos_ids)
        if work is not None:
            req.work_token, req.attempt = work.token, msg.attempt_base + work.deliveries
        return req
