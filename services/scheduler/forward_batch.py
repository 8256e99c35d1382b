"""What one model forward needs: flat token arrays for a mixed batch of extends and decodes.

A decode is an extend of length 1, so one layout covers both. Request i contributes
`extend_lens[i]` new tokens at positions prefix_lens[i] .. seq_lens[i]-1; their KV goes to the slots
`out_cache_loc` and their attention reads slots req_to_token[rows[i], :seq_lens[i]].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, tokens of all requests back to back
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    rows: torch.Tensor  # [B] int64, req_to_token rows
    prefix_lens: list[int]  # per request: tokens already in the KV pool before this step
    extend_lens: list[int]  # per request: tokens computed this step
    # indices into the T tokens whose hidden state becomes logits (last token of requests that sample)
    logits_idx: torch.Tensor
    # indices into the T tokens whose final hidden state is kept for prompt logprobs (None: none)
    lp_idx: torch.Tensor | None = None
    lp_hidden: torch.Tensor | None = None  # [len(lp_idx), H], set by the model
    # filled by the attention backend's `prepare`, reused by every layer
    attn: Any = field(default=None)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]
