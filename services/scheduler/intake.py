"""What arrives at a scheduler besides its steps: new requests (checked first: a bad one is answered
with a 400 at once and never runs), rejections, aborts and drops. `Scheduler` takes these methods;
they touch only its queues (`waiting`, `running`) and its step output."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from services.scheduler.request import Req, check_request
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams
from shared.transport import Work

if TYPE_CHECKING:
    from services.scheduler.memory import KVPool
    from services.scheduler.step_output import StepOutput


class RequestIntake:
    waiting: list[Req]
    running: list[Req]
    output: StepOutput
    kv: KVPool
    vocab_size: int
    context_len: int
    eos_ids: tuple[int, ...]

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
            req = self._blank(msg, None)
        if work is not None:
            req.work_token, req.attempt = work.token, work.deliveries
        if problem is None:
            self.waiting.append(req)
        else:
            self._finish_now(req, problem)

    def reject(self, msg: GenerateReq, message: str, status_code: int, work: Work | None = None) -> None:
        """Answer a request at once with an error, without running it."""
        self._finish_now(self._blank(msg, work), message, status_code)

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
                self.output.emit(req, [])
        for req in self.running:
            if req.rid in wanted and req.finish is None:
                req.finish = finish or {"type": "abort", "message": "aborted"}

    def _finish_now(self, req: Req, message: str, status_code: int = 400) -> None:
        req.finish = {"type": "abort", "message": message, "status_code": status_code}
        self.output.emit(req, [])

    def _blank(self, msg: GenerateReq, work: Work | None) -> Req:
        """A request to answer, not to run: msg's rid and subject only (its own fields may be unusable)."""
        blank = GenerateReq(rid=msg.rid, input_ids=[], sampling=SamplingParams(), out_subject=msg.out_subject)
        req = Req(blank, self.eos_ids)
        if work is not None:
            req.work_token, req.attempt = work.token, work.deliveries
        return req
