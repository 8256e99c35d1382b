"""The grammar bitmask as a logits processor: the rows of requests with a matcher keep only the
tokens their grammar allows next (everything else scores -inf). Each matcher fills its row of a host
int32 bitmask (one bit per token id, as wide as the grammar's vocabulary: ids of a model's vocabulary
padded past the tokenizer's tokens are never allowed); one copy to the device, one masked write for all
constrained rows (on CUDA the Triton kernel of sglbus_kernels/grammar_mask.py, in place; on a CPU each mask
byte looked up as its 8 bits, 3x faster than shifting every bit out). Rows without a grammar cost nothing.

The matchers advance on the host when the step's tokens are known (`Scheduler._complete`), not
here: under overlap scheduling the drawn ids are still on the device when on_sample runs. When the
step in flight completes between a step's forward and its draw (a constrained request decodes the
token in flight: `Scheduler._launch`'s defer), the masks are filled while it completes: `begin` takes
the draw's requests, `ready(r)` says r's matcher has taken its token, and every CHUNK ready rows are
filled on a worker thread (the libraries' fills release the GIL) while the scheduler thread goes on
accepting the next rows' tokens; `apply` waits for them and fills what is left.

The host bitmask lives in two reused buffers (pinned on CUDA, so the copy to the device reads them in
place); a buffer is written again only after the copy that read it two draws ago has finished."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.scheduler.constrained.grammar import Matcher, fill_bitmasks
from services.scheduler.host_copy import to_device
from services.scheduler.request import Req
from services.scheduler.sampling.processors import LogitsProcessor

CHUNK = 32  # rows per fill on the worker thread while the matchers advance


class _Fills:
    """The masks of one draw in flight: row of each constrained request, fills submitted, rows queued."""

    def __init__(self, rows: dict[int, int], host: torch.Tensor) -> None:
        self.rows, self.host = rows, host
        self.done: set[int] = set()  # uids whose row is filled or being filled
        self.queued: list[tuple[Matcher, int]] = []
        self.jobs: list[Future[None]] = []


class GrammarMaskProcessor(LogitsProcessor):
    name = "grammar"

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        self.vocab_size, self.device = vocab_size, device
        assert sys.byteorder == "little"  # byte k of a mask word holds tokens 8k..8k+7 of the word
        # a mask byte -> its 8 bits as "blocked" flags (1: the token is not allowed)
        self._blocked = (((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0).to(torch.uint8)
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # the last copy that read each buffer
        self._turn = 0
        self._fills: _Fills | None = None
        self._pool: ThreadPoolExecutor | None = None

    def uses(self, req: Req) -> bool:
        return req.grammar is not None

    # -- filling ahead of the draw ----------------------------------------------------------------
    def begin(self, reqs: Sequence[Req]) -> None:
        """The next draw is for `reqs` (or those of them still drawing then); their matchers take their
        tokens from now on (`ready`). The draw (`apply`) or `drop` ends what begin starts."""
        self.drop()
        rows = {r.uid: i for i, r in enumerate(reqs) if r.matcher is not None}
        words = next((r.matcher.mask_words for r in reqs if r.matcher is not None), 0)
        self._fills = _Fills(rows, self._host(len(reqs), words)) if rows else None
        if self._fills is not None:
            for r in reqs:  # no token in flight: its matcher is where the draw needs it already
                if r.matcher is not None and not r.pending:
                    self.ready(r)

    def ready(self, r: Req) -> None:
        """r's matcher is in its state for the next draw (nothing changes it before the draw)."""
        f = self._fills
        if f is None or r.matcher is None or (row := f.rows.get(r.uid)) is None or r.uid in f.done:
            return
        f.done.add(r.uid)
        f.queued.append((r.matcher, row))
        if len(f.queued) >= CHUNK:
            self._submit(f)

    def drop(self) -> None:
        """No draw follows `begin` (every request of it finished, or the step failed)."""
        fills, self._fills = self._fills, None
        _settle(fills)

    def _submit(self, f: _Fills) -> None:
        if not f.queued:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        matchers, rows = [m for m, _ in f.queued], [j for _, j in f.queued]
        f.queued = []
        f.jobs.append(self._pool.submit(fill_bitmasks, matchers, f.host, rows))

    def _host(self, n: int, words: int) -> torch.Tensor:
        """A host buffer of at least n mask rows of `words` words (the grammar backend's width) that no
        copy still reads."""
        self._turn ^= 1
        t, buf = self._turn, self._buffers[self._turn]
        if self._copied[t] is not None:
            self._copied[t].synchronize()  # type: ignore[union-attr]
            self._copied[t] = None
        if buf is None or buf.shape[0] < n or buf.shape[1] != words:
            rows = max(n, 2 * buf.shape[0] if buf is not None else 64)
            pin = self.device.type == "cuda"
            buf = self._buffers[t] = torch.empty((rows, words), dtype=torch.int32, pin_memory=pin)
        return buf

    # -- the draw ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Req], output_lens: torch.Tensor) -> None:
        fills, self._fills = self._fills, None  # taken at once: a retry row by row fills afresh
        if not self.active:
            return
        idx = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not idx:
            return
        if fills is not None and any(reqs[i].uid not in fills.rows for i in idx):
            _settle(fills)  # not the draw `begin` planned for: let its fills end, start afresh
            fills = None
        if fills is None:
            words = reqs[idx[0]].matcher.mask_words  # type: ignore[union-attr]
            fills = _Fills({reqs[i].uid: k for k, i in enumerate(idx)}, self._host(len(idx), words))
        for i in idx:  # rows no matcher reported ready for are filled here
            if (uid := reqs[i].uid) not in fills.done:
                fills.done.add(uid)
                fills.queued.append((reqs[i].matcher, fills.rows[uid]))  # type: ignore[arg-type]
        missing, fills.queued = fills.queued, []
        for job in fills.jobs:
            job.result()
        if missing:
            fill_bitmasks([m for m, _ in missing], fills.host, [j for _, j in missing])
        src = [fills.rows[reqs[i].uid] for i in idx]  # the host row of each masked logits row
        words = self._upload(fills.host[: max(src) + 1])
        if src != list(range(len(idx))):
            words = words[to_device(src, torch.int64, words.device)]
        self._mask(logits, words, idx)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return host
        words = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event
        return words

    def _mask(self, logits: torch.Tensor, words: torch.Tensor, idx: list[int]) -> None:
        rows = to_device(idx, torch.int64, logits.device)
        if logits.is_cuda:  # in place, no [rows, vocab] temporary
            from sglbus_kernels.grammar_mask import apply_bitmask

            apply_bitmask(logits, words, rows)
            return
        octets = words.view(torch.uint8).view(len(idx), -1).long()
        blocked = torch.nn.functional.embedding(octets, self._blocked).view(len(idx), -1)
        if (past := logits.shape[1] - blocked.shape[1]) > 0:  # ids past the grammar's vocabulary
            blocked = torch.nn.functional.pad(blocked, (0, past), value=1)
        blocked = blocked[:, : logits.shape[1]]
        if len(idx) == logits.shape[0]:  # every row constrained: in place
            logits.masked_fill_(blocked.bool(), float("-inf"))
        else:
            logits[rows] = logits[rows].masked_fill(blocked.bool(), float("-inf"))


def _settle(fills: _Fills | None) -> None:
    """Wait for the fill jobs of a plan no draw will use: its host buffer is written again two draws on."""
    for job in fills.jobs if fills is not None else ():
        job.exception()
