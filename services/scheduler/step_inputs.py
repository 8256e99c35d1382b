"""What a step's requests put into the forward, gathered on the host in one pass over the batch:
the flat token ids, each request's row / prefix / extend length, which tokens become logits (the last
of each request that samples) or prompt logprobs, and which inputs are still on the device (a token
the step in flight drew, under overlap scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.request import Req


@dataclass
class StepInputs:
    ids: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    samplers: list[Req] = field(default_factory=list)
    logits_idx: list[int] = field(default_factory=list)
    lp_idx: list[int] = field(default_factory=list)
    lp_reqs: list[tuple[Req, int]] = field(default_factory=list)  # owing prompt logprobs: (req, count)
    # tokens the step in flight drew: their indices here, then the rows of that step's draw (flat)
    from_flight: list[int] = field(default_factory=list)
    flight_rows: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @classmethod
    def collect(cls, batch: list[Req]) -> StepInputs:
        s = cls()
        start = 0
        for r in batch:
            c, n = r.num_computed, r.extend_len
            s.rows.append(r.row)
            s.prefix_lens.append(c)
            s.extend_lens.append(n)
            p = len(r.prompt)
            if r.pending:  # decodes the token the step in flight drew: filled in on the device
                s.from_flight.append(start)
                s.flight_rows.append(r.pending_at)
                s.ids.append(0)
            elif n == 1:
                s.ids.append(r.prompt[c] if c < p else r.output[c - p])
            else:
                s.ids.extend(r.fill[c : c + n])
            if r.lp_pos < r.lp_end:  # the cache match stopped at lp_pos, so c <= lp_pos
                a, b = r.lp_pos, min(r.lp_end, c + n)
                if b > a:
                    s.lp_idx.extend(range(start + a - c, start + b - c))
                    s.lp_reqs.append((r, b - a))
            start += n
            if c + n == p + len(r.output) + r.pending and r.max_new_tokens > len(r.output) + r.pending:
                s.samplers.append(r)
                s.logits_idx.append(start - 1)
        s.num_tokens = start
        return s
