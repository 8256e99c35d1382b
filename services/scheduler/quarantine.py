"""Requests that follow a crash run alone, so that a request that crashes its scheduler is found out,
and charged, without taking the others down with it again.

A delivery that follows a crash (the work queue's second or later, or a request its gateway routed
again because its worker died: `attempt_base`) is a *suspect*, unless this scheduler knows it was
innocent (crash_record.py). Suspects run one at a time, each in forward batches of its own:

    step:    1        2         3        4         5        6 ...
    batch:   normal   S alone   normal   S alone   normal   normal (S joined: its window ended)

- A suspect runs alone for its window: its prefill and first decode step (`WINDOW_TOKENS` output
  tokens), where a bad prompt, sampling setting or grammar shows; then it joins the batch. One that was
  charged a crash before, or that passed its window once and still came back a suspect (it crashed a
  batch later on), runs alone until it finishes: every crash is then charged, so the count is bounded.
- Alone steps alternate with the others' steps (those go on at half speed while a suspect runs), the step
  in flight completes before one (nothing else is on the device then), and an alone step completes
  before the next is launched, so a fault surfaces within it. Between its turns a suspect steps aside
  (its KV goes to the prefix cache, as in a retraction), so that it holds no room the others need.
- A death in an alone step is charged to its suspect (the crash record's mark, written before the step);
  the others held here were not in it. At `MAX_CRASHES` the request ends with an error (500), delivered
  to its gateway like an abort, and the gateway's acknowledgement removes it from the work queue.
- A step that raises (`step_failed`): the process stops, as before; an alone suspect is charged; the
  others are given back to the work queue (not failed: only in-process, where nothing runs them again).

The suspects stay in the scheduler's `waiting` and `running` lists (aborts, drops and keep-alives see
them); a step's scheduling sees a view of those lists, with or without them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from services.scheduler.crash_record import CrashRecord
from services.scheduler.request import DROPPED, Req
from shared.finish import Abort
from shared.messages import MAX_CRASHES, MAX_DELIVERIES, GenerateReq

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

WINDOW_TOKENS = 2  # output tokens a suspect draws alone: its prefill's and one decode step's


class Trial(NamedTuple):
    """How a delivery that follows a crash runs: `refuse` says why it does not run again at all."""

    key: str  # the delivery's rid: what the crash record counts
    full: bool  # alone until it finishes (else for its window)
    refuse: str | None = None


@dataclass
class Suspect:
    req: Req
    key: str
    full: bool
    blocked_since: float | None = None  # its turn came and it found no room, since then


def crashed_message(crashes: int) -> str:
    return f"this request crashed the scheduler {crashes} times; not retried"


class Quarantine:
    def __init__(self, record: CrashRecord | None = None) -> None:
        self.record = record or CrashRecord()
        self.suspects: dict[int, Suspect] = {}  # a request's uid -> its suspect entry
        self.alone: Suspect | None = None  # the suspect of the step in progress, marked in the record
        self.steps_alone = 0
        self._last_alone = False  # the last step ran a suspect alone: the others' turn
        self._ended = False  # a failed step settled what is held here: a stop adds nothing

    # -- intake ---------------------------------------------------------------------------------
    def judge(self, msg: GenerateReq, deliveries: int) -> Trial | None:
        """A delivery that follows a crash: None when it runs as any other (this scheduler knows it is
        innocent), else its trial."""
        if self.record.take_innocent([msg.rid, *(m.rid for m in msg.then)]):
            return None
        key, record = msg.rid, self.record
        crashes = record.crashes(key)
        refuse = crashed_message(crashes) if crashes >= MAX_CRASHES else None
        if not record.durable and deliveries > MAX_DELIVERIES:  # no record of who crashed alone
            refuse = (f"the request was delivered {deliveries} times and every scheduler that ran it "
                      "stopped; it is not tried again")  # fmt: skip
        return Trial(key, crashes > 0 or record.passes(key) > 0, refuse)

    def watch(self, trial: Trial, reqs: Iterable[Req]) -> None:
        """Run these requests of one delivery (the request and those it brings) as suspects."""
        for req in reqs:
            self.suspects[req.uid] = Suspect(req, trial.key, trial.full)
        log.info("%s follows a crash: it runs alone %s", trial.key,
                 "until it finishes" if trial.full else "for its first steps")  # fmt: skip

    def gave_back(self, rids: Iterable[str]) -> None:
        """These requests were given back to the work queue on purpose: their next delivery is no
        sign of a fault."""
        self.record.add_innocent(rids)

    # -- the step -------------------------------------------------------------------------------
    def schedule(
        self, sched: Scheduler, schedule: Callable[[], list[Req]], flush: Callable[[], None]
    ) -> tuple[list[Req], Suspect | None]:
        """The step's batch (`schedule` on a view of the scheduler's lists), and the suspect it runs
        alone (then marked in the record) or None."""
        if not self.suspects:  # the usual case
            return schedule(), None
        self._forget_gone(sched)
        turn = self._turn(sched)
        if turn is not None and turn.req.row is None and turn.req.fill_len > sched.kv.size:
            self._outgrown(sched, turn)
            turn = None
        if turn is not None:
            flush()  # the step in flight completes first: the suspect is alone on the device
            batch = _in_view(sched, lambda r: r is turn.req, schedule)
            if batch:
                bystanders = [r.rid for r in _held(sched) if r.uid not in self.suspects]
                self.record.mark(turn.key, bystanders)
                self.alone, self._last_alone, turn.blocked_since = turn, True, None
                self.steps_alone += 1
                return batch, turn
            turn.blocked_since = turn.blocked_since or time.monotonic()  # no room (or its grammar compiles)
        self._last_alone = False
        # a suspect that found no room for too long: nobody new is admitted until it is
        held_back = {id(r) for r in sched.waiting} if self._starved(sched) else set()
        visible = lambda r: r.uid not in self.suspects and id(r) not in held_back
        return _in_view(sched, visible, schedule), None

    def ran(self, sched: Scheduler, suspect: Suspect | None) -> None:
        """The suspect's step alone completed: clear the mark; past its window it joins the batch,
        else it steps aside (its KV to the prefix cache, as a retraction) while the others step, so
        that it holds no room they may need (it takes its KV back from the cache on its next turn)."""
        if suspect is None:
            return
        self.alone = None
        self.record.unmark()
        req = suspect.req
        if req.finish is not None:
            self.suspects.pop(req.uid, None)
        elif not suspect.full and len(req.output) >= WINDOW_TOKENS:
            self.suspects.pop(req.uid, None)
            self.record.passed(suspect.key)
        else:
            sched.sampling.release(req)
            sched.tree.cache_finished(req)
            req.num_cached = req.num_computed = 0
            sched.running.remove(req)
            sched.waiting.insert(0, req)

    def step_failed(self, sched: Scheduler, message: str) -> list[str]:
        """A step raised and the scheduler stops: set each running request's end, record who is
        innocent, and return the work tokens to give back. A suspect that ran alone is charged (at
        MAX_CRASHES it ends with an error); requests in the failed batch go back as suspects; in-process
        (no work queue) the running requests end with `message`, as nothing would run them again."""
        alone, self.alone, self._ended = self.alone, None, True
        held, ended = _held(sched), set()
        if alone is not None:
            crashes = self.record.charge(alone.key)
            log.error("%s crashed the scheduler while it ran alone (crash %d of %d)",
                      alone.key, crashes, MAX_CRASHES)  # fmt: skip
            if crashes >= MAX_CRASHES:  # its delivery ends here (those it brings end with it)
                alone.req.finish = Abort(crashed_message(crashes), 500)
                ended.add(alone.req.work_token)
            in_batch = {alone.req.uid}
        else:
            in_batch = {r.uid for r in sched.running if r.uid not in self.suspects}
        for r in sched.running:
            r.extend_len = 0
            if r.finish is None:
                r.finish = DROPPED if r.work_token else Abort(message, 500)
        unknown = in_batch | self.suspects.keys()  # the others were not in the step: innocent
        self.record.add_innocent((r.rid for r in held if r.uid not in unknown), save=True)
        return sorted({r.work_token for r in held if r.work_token and r.work_token not in ended})

    def stopping(self, sched: Scheduler) -> None:
        """A clean stop: the requests held here come back through the work queue for no fault of theirs
        (suspects stay suspects)."""
        if not self._ended:
            self.record.add_innocent((r.rid for r in _held(sched) if r.uid not in self.suspects), save=True)

    # -- turns ----------------------------------------------------------------------------------
    def _turn(self, sched: Scheduler) -> Suspect | None:
        """The suspect to run alone in this step: the one running already, else the first waiting;
        none right after an alone step while others have work."""
        others = any(r.uid not in self.suspects for r in (*sched.running, *sched.waiting))
        if self._last_alone and others:
            return None
        for r in (*sched.running, *sched.waiting):
            if r.uid in self.suspects:
                return self.suspects[r.uid]
        return None

    def _outgrown(self, sched: Scheduler, suspect: Suspect) -> None:
        """Its tokens no longer fit in the whole pool (it stepped aside; running, it would have ended so)."""
        req = suspect.req
        del self.suspects[req.uid]
        sched.waiting.remove(req)
        req.finish = Abort(f"KV pool ({sched.kv.size} tokens) exhausted", 503)
        sched.output.emit(req, [])
        sched.release_held(req)

    def _starved(self, sched: Scheduler) -> bool:
        limit = time.monotonic() - sched.cfg.max_queue_wait
        return any(s.blocked_since is not None and s.blocked_since < limit for s in self.suspects.values())

    def _forget_gone(self, sched: Scheduler) -> None:
        """Suspects that ended, or were dropped or aborted, are no longer watched."""
        live = {r.uid for r in _held(sched)}
        for uid in [uid for uid in self.suspects if uid not in live]:
            del self.suspects[uid]


def _held(sched: Scheduler) -> list[Req]:
    return [*sched.waiting, *sched.running, *(r for group in sched.held.values() for r in group)]


def _in_view(sched: Scheduler, visible: Callable[[Req], bool], fn: Callable[[], list[Req]]) -> list[Req]:
    """fn() while the scheduler's `running` and `waiting` hold only the visible requests; the hidden
    ones are put back after (fn may admit, retract and release the visible ones)."""
    hidden_running = [r for r in sched.running if not visible(r)]
    hidden_waiting = [r for r in sched.waiting if not visible(r)]
    hidden = {id(r) for r in hidden_running + hidden_waiting}
    sched.running = [r for r in sched.running if id(r) not in hidden]
    sched.waiting = [r for r in sched.waiting if id(r) not in hidden]
    try:
        return fn()
    finally:
        sched.running = sched.running + hidden_running
        sched.waiting = sched.waiting + hidden_waiting
