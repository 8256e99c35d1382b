"""What one scheduler step sends to the detokenizer: one columnar `BatchTokenOut`, a row per request
that produced tokens or finished, and each request's `NewReqInfo` the first time it appears. It also
remembers when recent requests finished (`finished_since`): their outputs may have gone to a
detokenizer that was dead by then."""

from __future__ import annotations

import time
from collections import deque

from services.scheduler.logprobs import pack
from services.scheduler.request import Req
from shared.messages import BatchTokenOut, NewReqInfo

_FINISHED_KEPT = 65536  # (time, work token) of the requests that finished last


class StepOutput:
    def __init__(self) -> None:
        self._out = BatchTokenOut()
        self._finished: deque[tuple[float, str]] = deque(maxlen=_FINISHED_KEPT)

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
        if req.finish is not None and req.work_token:
            self._finished.append((time.monotonic(), req.work_token))
        if req.lp is not None or out.logprobs:
            out.logprobs += [None] * (len(out.rids) - 1 - len(out.logprobs))
            lp = None
            if req.lp is not None:
                lp = pack(req.lp_in, req.lp_out)
                req.lp_in, req.lp_out = [], []
            out.logprobs.append(lp)

    def finished_since(self, t: float) -> list[str]:
        """The work tokens of requests whose final output went out at or after monotonic time t."""
        return list(dict.fromkeys(tok for at, tok in self._finished if at >= t))

    def take(self) -> BatchTokenOut | None:
        """The rows added since the last call, or None if there were none."""
        out, self._out = self._out, BatchTokenOut()
        return out if out.rids else None
