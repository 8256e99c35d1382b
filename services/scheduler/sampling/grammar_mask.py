"""The grammar bitmask as a logits processor: the rows of requests with a matcher keep only the
tokens their grammar allows next (everything else scores -inf). Each matcher fills its row of a
host int32 bitmask (one bit per token id); one copy to the device, one unpack, one masked write for
all constrained rows (on CUDA the Triton kernel of kernels/grammar_mask.py, in place; on a CPU each
mask byte looked up as its 8 bits, 3x faster than shifting every bit out). Rows without a grammar
cost nothing. The matchers advance on the host when
the step's tokens are known (`Scheduler._complete`), not here: under overlap scheduling the drawn
ids are still on the device when on_sample runs."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from services.scheduler.constrained.grammar import fill_bitmasks
from services.scheduler.host_copy import to_device
from services.scheduler.request import Req
from services.scheduler.sampling.processors import LogitsProcessor


class GrammarMaskProcessor(LogitsProcessor):
    name = "grammar"

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        self.vocab_size, self.device = vocab_size, device
        self.words = (vocab_size + 31) // 32
        assert sys.byteorder == "little"  # byte k of a mask word holds tokens 8k..8k+7 of the word
        # a mask byte -> its 8 bits as "blocked" flags (1: the token is not allowed)
        self._blocked = (((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0).to(torch.uint8)

    def uses(self, req: Req) -> bool:
        return req.grammar is not None

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], output_lens: torch.Tensor) -> None:
        if not self.active:
            return
        idx = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not idx:
            return
        host = torch.zeros((len(idx), self.words), dtype=torch.int32)
        fill_bitmasks([reqs[i].matcher for i in idx], host)
        words = to_device(host, torch.int32, self.device)
        rows = to_device(idx, torch.int64, self.device)
        if logits.is_cuda:  # in place, no [rows, vocab] temporary
            from kernels.grammar_mask import apply_bitmask

            apply_bitmask(logits, words, rows)
            return
        octets = words.view(torch.uint8).view(len(idx), -1).long()
        blocked = torch.nn.functional.embedding(octets, self._blocked).view(len(idx), -1)[
            :, : logits.shape[1]
        ]
        if len(idx) == logits.shape[0]:  # every row constrained: in place
            logits.masked_fill_(blocked.bool(), float("-inf"))
        else:
            logits[rows] = logits[rows].masked_fill(blocked.bool(), float("-inf"))
