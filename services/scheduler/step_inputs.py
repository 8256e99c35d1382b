"""What a step's requests put into the forward, gathered on the host in one pass over the batch:
the flat token ids, each request's row / prefix / extend length, which tokens become logits (the last
of each request that samples) or prompt logprobs, and which inputs are still on the device (a token
the step in flight drew, under overlap scheduling); then the step's ForwardBatch from them
(`forward_batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.host_copy import to_device
from services.scheduler.request import Req
from sglbus_kernels.cascade_plan import CascadePlan

# a step of short extends may run as one-token rows (`as_rows`) when each extend has at most this many
# tokens and the rows re-read at most this many KV entries in all (row j of an extend reads its prefix
# again: ~130 KB a token for an 8B model, so 2^17 entries are ~17 GB, a few ms on an H200, well under
# what an eager step costs over a graph replay)
ROWS_MAX_EXTEND = 16
ROWS_MAX_READS = 1 << 17


@dataclass
class StepInputs:
    ids: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    samplers: list[Req] = field(default_factory=list)
    logits_idx: list[int] = field(default_factory=list)
    # requests that end at their prompt and read its next-token logprobs (`Req.reads_next_logprobs`):
    # their last token's logits come after the samplers' (`logits_idx` ends with theirs)
    readers: list[Req] = field(default_factory=list)
    lp_idx: list[int] = field(default_factory=list)
    lp_reqs: list[tuple[Req, int]] = field(default_factory=list)  # owing prompt logprobs: (req, count)
    # tokens the step in flight drew: their indices here, then the rows of that step's draw (flat)
    from_flight: list[int] = field(default_factory=list)
    flight_rows: list[int] = field(default_factory=list)
    # requests whose extend holds prompt tokens (a chunk, a whole prompt, a retracted request's prompt
    # and output again), with their computed length after the step: their prefix is shared at once; a
    # running request's jump-forward extend (output tokens alone) waits for its finish, as decoded
    # tokens do (caching it each step was ~40% of a constrained JSON step's end)
    prompt_extends: list[tuple[Req, int]] = field(default_factory=list)
    num_tokens: int = 0

    @classmethod
    def collect(cls, batch: list[Req]) -> StepInputs:
        s = cls()
        start = 0
        reader_idx: list[int] = []
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
                if n > 1 and c < p:
                    s.prompt_extends.append((r, c + n))
            if r.lp_pos < r.lp_end:  # the cache match stopped at lp_pos, so c <= lp_pos
                a, b = r.lp_pos, min(r.lp_end, c + n)
                if b > a:
                    s.lp_idx.extend(range(start + a - c, start + b - c))
                    s.lp_reqs.append((r, b - a))
            start += n
            if c + n == p + len(r.output) + r.pending:  # every known token computed: it samples, or reads
                if r.max_new_tokens > len(r.output) + r.pending:
                    s.samplers.append(r)
                    s.logits_idx.append(start - 1)
                elif r.reads_next_logprobs:
                    s.readers.append(r)
                    reader_idx.append(start - 1)
        s.logits_idx += reader_idx
        s.num_tokens = start
        return s

    def fits_rows(self, max_tokens: int) -> bool:
        """Whether this step, which has extends, may run as one-token rows (`as_rows`): at most
        max_tokens rows (the largest CUDA graph), no prompt logprobs, short extends, bounded re-reads."""
        if self.num_tokens == len(self.rows) or self.num_tokens > max_tokens or self.lp_idx:
            return False
        reads = 0
        for c, n in zip(self.prefix_lens, self.extend_lens, strict=True):
            if n > ROWS_MAX_EXTEND:
                return False
            reads += n * (c + n) if n > 1 else 0
        return reads <= ROWS_MAX_READS

    def as_rows(self) -> None:
        """Every token becomes a one-token row of its request, so the step runs in DECODE mode (a CUDA
        graph replay instead of an eager extend: jump-forward's forced tokens, the few new tokens of a
        request after a cache hit). Row j of a k-token extend attends to its prefix and the j tokens
        before it, which each layer stores before it attends. The flat token order is unchanged, so
        the logits and in-flight indices stay as they are."""
        rows: list[int] = []
        prefix: list[int] = []
        for row, c, n in zip(self.rows, self.prefix_lens, self.extend_lens, strict=True):
            rows += [row] * n
            prefix += range(c, c + n)
        self.rows, self.prefix_lens, self.extend_lens = rows, prefix, [1] * len(rows)

    def forward_batch(
        self,
        loc: torch.Tensor,
        table: torch.Tensor,
        device: torch.device,
        cascade: CascadePlan | None,
        in_flight: torch.Tensor | None,
    ) -> ForwardBatch:
        """The step's ForwardBatch on `device`; the new tokens' slots `loc` go into their rows of the
        req_to_token `table` (one scatter), and the tokens the step in flight drew are filled in from
        its draw `in_flight` (on the device, no wait)."""
        # every token samples (a decode batch): no gather (readers' rows go last: never in token order)
        every = len(self.logits_idx) == self.num_tokens and not self.readers
        fb = ForwardBatch.build(self.ids, self.rows, self.prefix_lens, self.extend_lens, loc,
                                None if every else self.logits_idx, self.lp_idx, device, cascade)  # fmt: skip
        fb.store_slots(table)
        if self.from_flight:
            assert in_flight is not None
            n = len(self.from_flight)
            pairs = to_device(self.from_flight + self.flight_rows, torch.int64, device)
            fb.input_ids[pairs[:n]] = in_flight[pairs[n:]]  # token index <- row in flight
        return fb
