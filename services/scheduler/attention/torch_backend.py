"""Reference attention backend on torch's scaled_dot_product_attention (CPU and GPU; used by CI).

Decodes (one new token each) are gathered into one padded batch: a single SDPA call with a key mask.
Extends (several new tokens) run one SDPA call each, causal with an offset for their cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.scheduler.attention.base import AttentionBackend
from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.rotary import Rotary


@dataclass
class _Extend:
    start: int  # first token of this request in the flat batch
    length: int
    kv_idx: torch.Tensor  # [S] slots of the whole sequence
    mask: torch.Tensor | None  # [length, S] bool; None: plain causal (no cached prefix)


@dataclass
class _Meta:
    dec_tok: torch.Tensor | None  # [Bd] token index of each decode in the flat batch
    dec_idx: torch.Tensor | None  # [Bd, L] slots, padded with slot 0
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, L] bool, None when all sequences have the same length
    dec_is_all: bool  # every token of the batch is a decode, in order
    extends: list[_Extend]


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
                extends.append(_Extend(starts, ext, idx, mask))
            starts += ext
        dec_tok = dec_idx = dec_mask = None
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
        self.meta = _Meta(dec_tok, dec_idx, dec_mask, len(dec) == len(ext_lens) and not extends, extends)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        fb: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        if rotary is not None:
            q, k = rotary.rotate(q, k, fb.positions)
        meta = self.meta
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
            o = F.scaled_dot_product_attention(
                qd.unsqueeze(2), kd, vd, attn_mask=meta.dec_mask, scale=self.scale, enable_gqa=True
            ).squeeze(2)
            if meta.dec_is_all:
                return o
            out[meta.dec_tok] = o
        for e in meta.extends:
            # 4-D with a batch of one: CPU SDPA is ~7x slower on 3-D inputs
            qe = q[e.start : e.start + e.length].transpose(0, 1)[None]  # [1, H, n, D]
            ke = k_pool.index_select(0, e.kv_idx).transpose(0, 1)[None]  # [1, Hkv, S, D]
            ve = v_pool.index_select(0, e.kv_idx).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qe, ke, ve, attn_mask=e.mask, is_causal=e.mask is None, scale=self.scale, enable_gqa=True
            )
            out[e.start : e.start + e.length] = o[0].transpose(0, 1)
        return out
