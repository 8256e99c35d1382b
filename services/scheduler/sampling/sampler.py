"""Batched sampling: greedy, temperature, top-k, top-p, min-p, and seeded reproducible draws.

Per-request parameters live in tensors built once per batch composition (`SamplingInfo.build`);
a step is tensor ops only. Sorting the vocabulary happens only when some row filters by top-k/p or
min-p. Rows with a `sampling_seed` draw with Gumbel noise hashed from (seed, output position, token),
so the same seed gives the same tokens whatever batch the request lands in; seeds are taken mod 2^63
(as the gateway derives the seeds of n > 1 samples), so any seed the bus can carry fits int64.

One bad row never breaks the batch's draw: a row whose logits are NaN, +inf or beyond +-1e30 is
repaired (NaN bans that token, the rest is clamped) and a row left without any usable logit samples
token -1, which the scheduler turns into an abort of that request alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.scheduler.host_copy import to_device
from shared.sampling_params import GREEDY_TEMPERATURE, SamplingParams

_MASK53 = (1 << 53) - 1
SEED_MODULUS = 1 << 63
# a repaired row's logits stay within +-_LOGIT_CAP: divided by any non-greedy temperature they stay finite
_LOGIT_CAP = 1e30
assert _LOGIT_CAP / GREEDY_TEMPERATURE < torch.finfo(torch.float32).max
# a sampled draw makes [rows, vocab] temporaries (probabilities, a sort and its int64 order, seeded
# noise in int64 and float64): past this many logits it runs in slices of rows, so its memory stays
# ~2.5 GB at most whatever the batch (2,400 rows of a 128k vocabulary would take ~20 GB at once, more
# than the KV pool leaves free on a GPU)
DRAW_SLICE_LOGITS = 1 << 26


@dataclass
class SamplingInfo:
    """A batch's sampling parameters as device columns; an all-greedy batch (its draw is an argmax)
    has none: no per-row Python or host copies for the batch that serving throughput runs at."""

    temperatures: torch.Tensor | None  # [B, 1] float32 (1.0 for greedy rows, unused there)
    top_ks: torch.Tensor | None  # [B, 1] int64, vocab size when unset
    top_ps: torch.Tensor | None  # [B, 1]
    min_ps: torch.Tensor | None  # [B, 1]
    greedy: torch.Tensor | None  # [B] bool
    seeds: torch.Tensor | None  # [B, 1] int64
    seeded: torch.Tensor | None  # [B] bool
    all_greedy: bool
    need_sort: bool
    need_min_p: bool
    any_seeded: bool

    def rows(self, a: int, b: int) -> SamplingInfo:
        """Rows a..b-1 (the batch-wide flags stay: they only ever allow more work than needed)."""
        if self.all_greedy:
            return self
        return SamplingInfo(
            self.temperatures[a:b], self.top_ks[a:b], self.top_ps[a:b], self.min_ps[a:b], self.greedy[a:b],
            self.seeds[a:b], self.seeded[a:b], self.all_greedy, self.need_sort, self.need_min_p,
            self.any_seeded,
        )  # fmt: skip

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> SamplingInfo:
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return cls(None, None, None, None, None, None, None, True, False, False, False)
        if not all(g or math.isfinite(p.temperature) for p, g in zip(params, greedy, strict=True)):
            # NaN probabilities would make multinomial fail the batch (on CUDA: the whole device)
            raise ValueError("a sampled row has a non-finite temperature")
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        seeded = [p.sampling_seed is not None and not g for p, g in zip(params, greedy, strict=True)]

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device).unsqueeze(1)

        return cls(
            temperatures=col(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
            ),
            top_ks=col(top_ks, torch.int64),
            top_ps=col([p.top_p for p in params], torch.float32),
            min_ps=col([p.min_p for p in params], torch.float32),
            greedy=to_device(greedy, torch.bool, device),
            seeds=col([(p.sampling_seed or 0) % SEED_MODULUS for p in params], torch.int64),
            seeded=to_device(seeded, torch.bool, device),
            all_greedy=all(greedy),
            need_sort=any(
                not g and (k < vocab_size or p.top_p < 1.0 or p.min_p > 0)
                for p, g, k in zip(params, greedy, top_ks, strict=True)
            ),
            need_min_p=any(p.min_p > 0 and not g for p, g in zip(params, greedy, strict=True)),
            any_seeded=any(seeded),
        )


def sample(
    logits: torch.Tensor, info: SamplingInfo, positions: torch.Tensor, check: bool = True
) -> torch.Tensor:
    """logits [B, V] (float32, or the model's bf16/fp16 for a batch no processor changed) -> token
    ids [B], -1 for a row without a usable logit; a draw other than greedy works on a float32 copy.
    `positions` [B, 1] int64: each row's output index, which keys the seeded noise. check=True looks
    on the host whether any row needs repair first (a sync; the usual case then skips the repair);
    check=False never waits for the GPU (overlap scheduling): an all-greedy batch on CUDA takes its
    ids from one kernel that repairs as it reads, any other batch is repaired in place first. The
    logits are the caller's scratch (the processors change them in place too): the repair may write
    into them."""
    if check:
        top, greedy_ids = logits.max(dim=-1)  # top is NaN where the row has one
        if bool(((top > -_LOGIT_CAP) & (top < _LOGIT_CAP)).all()):  # the usual case: nothing to repair
            if info.all_greedy:
                return greedy_ids

            def draw(a: int, b: int) -> torch.Tensor:
                return _draw(logits[a:b].float(), info.rows(a, b), positions[a:b], greedy_ids[a:b])

            return _by_slices(draw, logits.shape)
    elif info.all_greedy and logits.is_cuda:
        from sglbus_kernels.greedy_argmax import greedy_argmax

        return greedy_argmax(logits, _LOGIT_CAP)
    return _by_slices(
        lambda a, b: _repaired_draw(logits[a:b].float(), info.rows(a, b), positions[a:b]), logits.shape
    )


def row_slices(rows: int, vocab: int) -> list[tuple[int, int]]:
    """(a, b) row ranges of at most DRAW_SLICE_LOGITS logits each, covering rows 0..rows-1 (one range,
    possibly empty, when they fit): for [rows, vocab] work whose temporaries must stay bounded."""
    step = max(1, DRAW_SLICE_LOGITS // max(vocab, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)] or [(0, 0)]


def _by_slices(draw: Callable[[int, int], torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """draw(a, b) -> ids of rows a..b-1, over `row_slices`."""
    parts = [draw(a, b) for a, b in row_slices(*shape)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _repaired_draw(logits: torch.Tensor, info: SamplingInfo, positions: torch.Tensor) -> torch.Tensor:
    dead = _repair_(logits)
    return _draw(logits, info, positions, logits.argmax(dim=-1)).masked_fill(dead, -1)


def _repair_(logits: torch.Tensor) -> torch.Tensor:
    """In place: NaN bans its token, +inf and finite values past +-_LOGIT_CAP become +-_LOGIT_CAP, -inf
    stays banned; a row left with nothing allowed becomes all zeros (it draws anything; the caller
    replaces its token). Returns those rows, [B] bool."""
    logits.nan_to_num_(nan=float("-inf"), posinf=_LOGIT_CAP, neginf=float("-inf")).clamp_(max=_LOGIT_CAP)
    logits.masked_fill_((logits < -_LOGIT_CAP) & (logits > float("-inf")), -_LOGIT_CAP)
    dead = (logits == float("-inf")).all(dim=-1)
    logits.masked_fill_(dead.unsqueeze(1), 0.0)
    return dead


def _draw(
    logits: torch.Tensor, info: SamplingInfo, positions: torch.Tensor, greedy_ids: torch.Tensor
) -> torch.Tensor:
    if info.all_greedy:
        return greedy_ids
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_sort:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        drop = ((cum - sorted_probs) > info.top_ps) | (ranks >= info.top_ks)
        if info.need_min_p:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    sampled = torch.multinomial(probs, 1).squeeze(1)
    if info.any_seeded:
        noise = _hashed_exponential(info.seeds, positions, probs.shape[-1])
        # argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p (the "exponential race")
        seeded_ids = (probs / noise).argmax(dim=-1)
        sampled = torch.where(info.seeded, seeded_ids, sampled)
    return torch.where(info.greedy, greedy_ids, sampled)


def _hashed_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, V] that depends only on (seed, position, token id): a splitmix64-style hash."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=seeds.device).unsqueeze(0)
    x = seeds * -7046029254386353131 + positions * -4658895280553007687 + tokens  # wraps mod 2^64
    x = (x ^ (x >> 30)) * -4658895280553007687
    x = (x ^ (x >> 27)) * -7723592293110705685
    x = x ^ (x >> 31)
    u = ((x & _MASK53).double() + 0.5) / float(1 << 53)  # uniform in (0, 1)
    return (-torch.log(u)).float()


__all__ = ["GREEDY_TEMPERATURE", "SEED_MODULUS", "SamplingInfo", "sample"]
