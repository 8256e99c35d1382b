"""What one model forward reads: device tensors for a mixed batch of extends and decodes, built once
per step (`ForwardBatch.build`) with one host-to-device copy. Nothing writes to it after that: the
attention backend keeps its own per-step metadata, and the model returns what it computes.

A decode is an extend of length 1, so one layout covers both. Request i contributes
`extend_lens[i]` new tokens at positions prefix_lens[i] .. seq_lens[i]-1, stored back to back from
`extend_start_loc[i]` in the flat token arrays; their KV goes to the slots `out_cache_loc` and their
attention reads slots req_to_token[req_pool_indices[i], :seq_lens[i]].

    mode DECODE   every request adds exactly one token (T == B): decode kernels, CUDA graphs
    mode EXTEND   anything else (prefills, chunked prefills, decodes mixed in); the scheduler puts
                  the requests that add one token first (`num_decode` of them), so a backend can
                  run its decode kernel on those and its extend kernel on the rest
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from services.scheduler.host_copy import to_device
from sglbus_kernels.cascade_plan import CascadePlan


class ForwardMode(enum.Enum):
    DECODE = "decode"
    EXTEND = "extend"


@dataclass(frozen=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, tokens of all requests back to back
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64, req_to_token rows
    seq_lens: torch.Tensor  # [B] int64, prefix + extend
    prefix_lens: torch.Tensor  # [B] int64, tokens already in the KV pool before this step
    extend_lens: torch.Tensor  # [B] int64, tokens computed this step
    extend_start_loc: torch.Tensor  # [B] int64, first token of each request in the flat arrays
    # tokens whose hidden state becomes logits (last token of requests that sample); None: every token
    logits_idx: torch.Tensor | None
    # tokens whose final hidden state is returned for prompt logprobs (None: none)
    lp_idx: torch.Tensor | None
    # host copies (CPU tensors, no device sync to read) for backends that plan on the host
    seq_lens_cpu: torch.Tensor
    extend_lens_cpu: torch.Tensor
    max_extend_len: int
    num_decode: int  # the first num_decode requests add one token each (all of them in DECODE mode)
    # shared prefixes among the decode rows (sglbus_kernels/cascade_attention.py), or None
    cascade: CascadePlan | None = None
    # the packed host tensor this was built from and its layout (None: built otherwise, as the warm-up's)
    host: tuple[torch.Tensor, HostLayout] | None = None
    # a vision-language model's image rows for this step's image slots, or None
    mm: MultimodalBatch | None = None

    @property
    def batch_size(self) -> int:
        return self.seq_lens_cpu.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        logits_idx: list[int] | None,
        lp_idx: list[int],
        device: torch.device,
        cascade: CascadePlan | None = None,
    ) -> ForwardBatch:
        """From host lists: one packed int64 tensor, one copy to the device, then views of it. The
        arithmetic stays in Python lists (few torch calls: each releases the GIL, and a step's host work
        waits up to the switch interval to get it back while another thread of the process runs)."""
        b, t = len(rows), len(input_ids)
        seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        starts = list(itertools.accumulate(extend_lens, initial=0))[:b]
        decode = t == b
        if decode:
            positions, num_decode = prefix_lens, b
        else:
            positions = [j for p, s in zip(prefix_lens, seq, strict=True) for j in range(p, s)]
            num_decode = next((i for i, e in enumerate(extend_lens) if e != 1), b)
        host = torch.tensor([*input_ids, *positions, *rows, *seq, *prefix_lens, *extend_lens, *starts,
                             *(logits_idx or ()), *lp_idx], dtype=torch.int64)  # fmt: skip
        layout = HostLayout(t, b, None if logits_idx is None else len(logits_idx), len(lp_idx),
                            max(extend_lens, default=0), num_decode)  # fmt: skip
        return cls.from_host(host, layout, out_cache_loc, device, cascade)

    @classmethod
    def from_host(
        cls,
        host: torch.Tensor,
        layout: HostLayout,
        out_cache_loc: torch.Tensor,
        device: torch.device,
        cascade: CascadePlan | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """From `build`'s packed host tensor (one copy to the device, then views of it); input_ids: the
        tokens on the device instead of the host's (a tensor-parallel follower gets them from rank 0)."""
        t, b, n_lp = layout.num_tokens, layout.batch_size, layout.num_lp
        n_logits = layout.num_logits or 0
        sizes = (t, t, b, b, b, b, b, n_logits, n_lp)
        ids, pos, rows_d, seq_d, pre_d, ext_d, start_d, logits_d, lp_d = to_device(
            host, torch.int64, device
        ).split(sizes)
        seq_cpu, ext_cpu = host[2 * t + b : 2 * t + 2 * b], host[2 * t + 3 * b : 2 * t + 4 * b]
        return cls(
            mode=ForwardMode.DECODE if t == b else ForwardMode.EXTEND,
            input_ids=ids if input_ids is None else input_ids,
            positions=pos,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows_d,
            seq_lens=seq_d,
            prefix_lens=pre_d,
            extend_lens=ext_d,
            extend_start_loc=start_d,
            logits_idx=None if layout.num_logits is None else logits_d,
            lp_idx=lp_d if n_lp else None,
            seq_lens_cpu=seq_cpu,
            extend_lens_cpu=ext_cpu,
            max_extend_len=layout.max_extend_len,
            num_decode=layout.num_decode,
            cascade=cascade,
            host=(host, layout),
        )

    def store_slots(self, table: torch.Tensor) -> None:
        """Write the new tokens' slots (out_cache_loc) into their requests' rows of req_to_token."""
        rows = self.req_pool_indices
        # a decode batch has one token per row: no repeat_interleave, which may read its repeats on the host
        if self.mode is not ForwardMode.DECODE:
            rows = torch.repeat_interleave(rows, self.extend_lens, output_size=self.num_tokens)
        table[rows, self.positions] = self.out_cache_loc


@dataclass(frozen=True)
class MultimodalBatch:
    """Rows that replace token embeddings: `embeds` [M, hidden] go to the flat token indices
    `positions` [M] (an image's placeholder slots in this step's extend)."""

    embeds: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class HostLayout:
    """How `ForwardBatch.build` packed its host tensor (what a tensor-parallel follower needs to read it)."""

    num_tokens: int
    batch_size: int
    num_logits: int | None  # None: every token makes logits
    num_lp: int
    max_extend_len: int
    num_decode: int


@dataclass(frozen=True)
class LogitsOutput:
    logits: torch.Tensor  # [len(logits_idx) or T, vocab] float32
    lp_hidden: torch.Tensor | None  # [len(lp_idx), hidden], final-norm states for prompt logprobs
