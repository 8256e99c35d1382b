"""What one scheduler step sends to the detokenizer: one columnar `BatchTokenOut`, a row per request
that produced tokens or finished, and each request's `NewReqInfo` the first time it appears."""

from __future__ import annotations

from services.scheduler.logprobs import pack
from services.scheduler.request import Req
from shared.messages import BatchTokenOut, NewReqInfo


class StepOutput:
    def __init__(self) -> None:
        self._out = BatchTokenOut()

    def emit(self, req: Req, tokens: list[int]) -> None:
        """Add a row: `tokens` just produced by `req` (maybe none), its finish reason, its logprobs."""
        out = self._out
        if not req.announced:
            s = req.sampling
            out.new_reqs.append(
                NewReqInfo(
                    rid=req.rid,
                    out_subject=req.out_subject,
                    stop=s.stop,
                    stop_regex=s.stop_regex,
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

    def take(self) -> BatchTokenOut | None:
        """The rows added since the last call, or None if there were none."""
        out, self._out = self._out, BatchTokenOut()
        return out if out.rids else None
