"""Reference attention backend on torch's scaled_dot_product_attention (CPU and GPU; used by CI).

Decodes (one new token each) are gathered into one padded batch: a single SDPA call with a key mask.
Extends (several new tokens) run one SDPA call each, causal with an offset for their cached prefix.
A sliding window narrows those masks (built once per step and window); a soft-capped layer (Gemma 2)
computes its scores itself as transformers' eager attention does, since SDPA cannot cap them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.scheduler.attention.base import AttentionBackend, LayerAttention
from services.scheduler.forward_batch import ForwardBatch

_FULL = LayerAttention()


@dataclass
class _Extend:
    start: int  # first token of this request in the flat batch
    length: int
    kv_idx: torch.Tensor  # [S] slots of the whole sequence
    mask: torch.Tensor | None  # [length, S] bool; None: plain causal (no cached prefix)
    seq: int  # S

    def windowed(self, window: int) -> _Extend:
        """The same extend with keys limited to `window` before each query (its own included)."""
        if self.seq <= window:
            return self
        device = self.kv_idx.device
        q_pos = torch.arange(self.seq - self.length, self.seq, device=device).unsqueeze(1)
        k_pos = torch.arange(self.seq, device=device).unsqueeze(0)
        mask = (k_pos <= q_pos) & (q_pos - k_pos < window)
        return _Extend(self.start, self.length, self.kv_idx, mask, self.seq)


@dataclass
class _Meta:
    dec_tok: torch.Tensor | None  # [Bd] token index of each decode in the flat batch
    dec_idx: torch.Tensor | None  # [Bd, L] slots, padded with slot 0
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, L] bool, None when all sequences have the same length
    dec_lens: torch.Tensor | None  # [Bd] sequence lengths
    dec_is_all: bool  # every token of the batch is a decode, in order
    extends: list[_Extend]
    by_window: dict[int, tuple[torch.Tensor | None, list[_Extend]]]  # window -> (dec_mask, extends)

    def window(self, window: int) -> tuple[torch.Tensor | None, list[_Extend]]:
        """The decode mask and extends of a layer with this sliding window (0: none); built once a step."""
        if not window:
            return self.dec_mask, self.extends
        if window not in self.by_window:
            dec_mask = self.dec_mask
            if self.dec_idx is not None and self.dec_lens is not None:
                k_pos = torch.arange(self.dec_idx.shape[1], device=self.dec_idx.device).unsqueeze(0)
                lens = self.dec_lens.unsqueeze(1)
                dec_mask = ((k_pos < lens) & (k_pos >= lens - window))[:, None, None, :]
            self.by_window[window] = (dec_mask, [e.windowed(window) for e in self.extends])
        return self.by_window[window]


class TorchAttention(AttentionBackend):
    meta: _Meta

    def prepare(self, fb: ForwardBatch) -> None:
        table = self.req_to_token.table
        device = table.device
        starts, dec, extends = 0, [], []
        seq_lens, ext_lens = fb.seq_lens_cpu.tolist(), fb.extend_lens_cpu.tolist()
        for i, (ext, seq) in enumerate(zip(ext_lens, seq_lens, strict=True)):
            if ext == 1:
                dec.append((starts, i))
            elif ext > 1:
                prefix = seq - ext
                idx = table[fb.req_pool_indices[i], :seq]
                mask = None
                if prefix:
                    q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
                    mask = torch.arange(seq, device=device).unsqueeze(0) <= q_pos
                extends.append(_Extend(starts, ext, idx, mask, seq))
            starts += ext
        dec_tok = dec_idx = dec_mask = lens = None
        if dec:
            tok = [t for t, _ in dec]
            lens_cpu = [seq_lens[i] for _, i in dec]
            reqs = torch.tensor([i for _, i in dec], device=device)
            lens = torch.tensor(lens_cpu, device=device)
            max_len = max(lens_cpu)
            valid = torch.arange(max_len, device=device).unsqueeze(0) < lens.unsqueeze(1)
            dec_idx = table[fb.req_pool_indices[reqs], :max_len].masked_fill(~valid, 0)
            if min(lens_cpu) != max_len:
                dec_mask = valid[:, None, None, :]
            dec_tok = torch.tensor(tok, device=device)
        all_dec = len(dec) == len(ext_lens) and not extends
        self.meta = _Meta(dec_tok, dec_idx, dec_mask, lens, all_dec, extends, {})

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        fb: ForwardBatch,
        spec: LayerAttention | None = None,
    ) -> torch.Tensor:
        spec = spec or _FULL
        if spec.rotary is not None:
            q, k = spec.rotary.rotate(q, k, fb.positions)
        scale = self.scale if spec.scale is None else spec.scale
        meta = self.meta
        dec_mask, extends = meta.window(spec.window)
        k_pool, v_pool = self.kv.k[layer], self.kv.v[layer]
        k_pool[fb.out_cache_loc] = k
        v_pool[fb.out_cache_loc] = v
        out = q if meta.dec_is_all else torch.empty_like(q)
        if meta.dec_idx is not None:
            qd = q if meta.dec_is_all else q[meta.dec_tok]
            # index_select on a flat index is ~3x faster on CPU than advanced indexing
            shape = (*meta.dec_idx.shape, *k_pool.shape[1:])
            flat = meta.dec_idx.view(-1)
            kd = k_pool.index_select(0, flat).view(shape).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = v_pool.index_select(0, flat).view(shape).transpose(1, 2)
            o = _attend(qd.unsqueeze(2), kd, vd, dec_mask, False, scale, spec.softcap).squeeze(2)
            if meta.dec_is_all:
                return o
            out[meta.dec_tok] = o
        for e in extends:
            # 4-D with a batch of one: CPU SDPA is ~7x slower on 3-D inputs
            qe = q[e.start : e.start + e.length].transpose(0, 1)[None]  # [1, H, n, D]
            ke = k_pool.index_select(0, e.kv_idx).transpose(0, 1)[None]  # [1, Hkv, S, D]
            ve = v_pool.index_select(0, e.kv_idx).transpose(0, 1)[None]
            o = _attend(qe, ke, ve, e.mask, e.mask is None, scale, spec.softcap)
            out[e.start : e.start + e.length] = o[0].transpose(0, 1)
        return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    scale: float, softcap: float,
) -> torch.Tensor:  # fmt: skip
    """q [B, H, n, D], k/v [B, Hkv, S, D], mask broadcastable to [B, H, n, S] (True: attend)."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]  # transformers' eager attention, step for step
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, s = q.shape[2], k.shape[2]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
