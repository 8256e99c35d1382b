"""Logprobs of prompt and output tokens for the requests that ask (`return_logprob`).

They come from the model's raw distribution: log_softmax of the float32 logits before temperature,
penalties, logit_bias, min_new_tokens masking or top-k/p filtering (what the model thinks, not what the
sampler drew from). Prompt position i gets log P(prompt[i] | prompt[:i]), read from the logits at
position i - 1, so a request that wants prompt logprobs from `start_len` on must compute positions
start_len - 1 onward itself: its prefix-cache match stops there (`policy.match_key`).

Results stay numpy arrays on the request until its next output, then travel as raw bytes
(`messages.LogprobOut`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from shared.messages import LogprobOut

# prompt positions turned into full-vocabulary logits at once: bounds memory for long prompts
SLICE_ROWS = 256


@dataclass
class Rows:
    """Logprobs at m positions: of the token that came next, the top k, and the asked-for ids."""

    token: np.ndarray  # float32 [m]
    top_val: np.ndarray  # float32 [m, k]
    top_idx: np.ndarray  # int32 [m, k]
    ids_val: np.ndarray  # float32 [m, len(token_ids)]


def rows_from_logprobs(lp: torch.Tensor, targets: torch.Tensor, top_k: int, token_ids: list[int]) -> Rows:
    """lp: log-probabilities [m, V]; targets: [m] ids whose logprob is wanted."""
    token = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    if top_k:
        top_val, top_idx = lp.topk(top_k, dim=-1)  # sorted, best first
    else:
        top_val, top_idx = lp.new_empty(lp.shape[0], 0), targets.new_empty(lp.shape[0], 0)
    ids_val = lp[:, token_ids] if token_ids else lp.new_empty(lp.shape[0], 0)
    return Rows(
        token.float().cpu().numpy(),
        top_val.float().cpu().numpy(),
        top_idx.to(torch.int32).cpu().numpy(),
        ids_val.float().cpu().numpy(),
    )


def output_rows(
    lp: torch.Tensor, sampled: torch.Tensor, top_ks: list[int], token_ids: list[list[int]]
) -> list[Rows]:
    """One row per request of a decode batch: lp [B, V], the sampled ids [B]; one top-k for all rows
    (the largest k asked), sliced per request, and one copy to the host."""
    every = rows_from_logprobs(lp, sampled, max(top_ks), [])
    out = []
    for j, (k, ids) in enumerate(zip(top_ks, token_ids, strict=True)):
        ids_val = lp[j, ids].float().cpu().numpy()[None] if ids else np.empty((1, 0), np.float32)
        out.append(
            Rows(every.token[j : j + 1], every.top_val[j : j + 1, :k], every.top_idx[j : j + 1, :k], ids_val)
        )
    return out


def next_rows(lp: torch.Tensor, top_ks: list[int], token_ids: list[list[int]]) -> list[Rows]:
    """One row per request that ends at its prompt without drawing (max_new_tokens 0): the top k and
    the asked-for ids of the next position, lp [B, V], and no token logprob (there is no token: its
    `token` is empty, so the row adds to the top and ids arrays only)."""
    rows = output_rows(lp, lp.new_zeros(lp.shape[0], dtype=torch.int64), top_ks, token_ids)
    return [dataclasses.replace(r, token=r.token[:0]) for r in rows]


def input_rows(
    hidden: torch.Tensor, to_logits, targets: list[int], top_k: int, token_ids: list[int]
) -> list[Rows]:
    """Prompt logprobs from final hidden states [m, H] (position p predicts targets[p]), a slice of
    positions at a time so a long prompt never holds [m, vocab] logits at once."""
    dev = hidden.device
    out = []
    for s in range(0, hidden.shape[0], SLICE_ROWS):
        lp = torch.log_softmax(to_logits(hidden[s : s + SLICE_ROWS]).float(), dim=-1)
        t = torch.tensor(targets[s : s + SLICE_ROWS], dtype=torch.int64, device=dev)
        out.append(rows_from_logprobs(lp, t, top_k, token_ids))
    return out


def pack(inputs: list[Rows], outputs: list[Rows]) -> LogprobOut:
    """The bus message for what accumulated; empty sides stay empty bytes."""
    msg = LogprobOut()
    for side, parts in (("input", inputs), ("output", outputs)):
        if not parts:
            continue
        setattr(msg, f"{side}_token", _bytes(np.concatenate([r.token for r in parts]), "<f4"))
        setattr(msg, f"{side}_top_val", _bytes(np.concatenate([r.top_val for r in parts]), "<f4"))
        setattr(msg, f"{side}_top_idx", _bytes(np.concatenate([r.top_idx for r in parts]), "<i4"))
        setattr(msg, f"{side}_ids_val", _bytes(np.concatenate([r.ids_val for r in parts]), "<f4"))
    return msg


def _bytes(a: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()
