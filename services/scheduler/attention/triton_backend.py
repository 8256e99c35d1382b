"""Attention on Triton kernels (sglbus_kernels/) that read the token-level pool in place: no KV is gathered
or copied. The default on CUDA; under `TRITON_INTERPRET=1` it also runs on CPU (tests).

    store     sglbus_kernels.rope.rope_store_kv: q and k rotated (RoPE) and the step's new K/V written to
              their slots in one launch (sglbus_kernels.kv_store without RoPE)
    DECODE    sglbus_kernels.decode_attention: flash-decoding (split-K over the sequence), GQA-grouped;
              the grid depends only on the batch size, so a CUDA graph captures it
    EXTEND    sglbus_kernels.extend_attention: causal attention over cached prefix + new tokens, per request;
              the batch's leading one-token requests (decodes mixed in, `fb.num_decode`) go to the
              decode kernel instead, which reads each kv head once for its whole q-head group
    CASCADE   with `fb.cascade` (services/scheduler/cascade.py), a shared prefix is attended once
              per tile of its requests (sglbus_kernels.cascade_attention) inside decode_attention

Nothing is planned per step: the kernels read the batch's device tensors directly. A layer's sliding
window and soft-cap (`LayerAttention`) go to both kernels; a windowed layer attends without the
cascade (its shared prefix may lie partly outside the window).
"""

from __future__ import annotations

import torch

from services.scheduler.attention.base import AttentionBackend, LayerAttention
from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.memory import KVPool, ReqToTokenPool
from sglbus_kernels.decode_attention import DEFAULT_KV_SPLITS, decode_attention, decode_scratch
from sglbus_kernels.extend_attention import extend_attention
from sglbus_kernels.kv_store import store_kv
from sglbus_kernels.rope import rope_store_kv


class TritonAttention(AttentionBackend):
    supports_cuda_graph = True
    supports_cascade = True

    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int) -> None:
        super().__init__(kv, req_to_token, num_heads, head_dim)
        rows = req_to_token.table.shape[0]  # at most one decode per row
        self.scratch = decode_scratch(rows, num_heads, head_dim, DEFAULT_KV_SPLITS, kv.device)

    def init_cuda_graph(self, max_bs: int) -> None:
        assert max_bs <= self.scratch[0].shape[0], "decode scratch smaller than the largest graph"

    def prepare(self, fb: ForwardBatch) -> None:
        pass

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
        k_buf, v_buf = self.kv.k[layer], self.kv.v[layer]
        rotary = spec.rotary
        if rotary is None:
            store_kv(k_buf, v_buf, fb.out_cache_loc, k, v)
        else:  # q rotated in place; k rotated into the pool only (the kernels read keys from there)
            rope_store_kv(q, k, v, rotary.cos, rotary.sin, fb.positions, k_buf, v_buf, fb.out_cache_loc)
        scale = self.scale if spec.scale is None else spec.scale
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        table = self.req_to_token.table
        nd = fb.num_decode  # the whole batch in DECODE mode
        if nd:
            decode_attention(
                q[:nd], k_buf, v_buf, out[:nd], table, fb.req_pool_indices[:nd], fb.seq_lens[:nd],
                self.scratch, scale, None if spec.window else fb.cascade,
                window=spec.window, softcap=spec.softcap,
            )  # fmt: skip
        if nd < fb.batch_size:
            extend_attention(
                q, out, k_buf, v_buf, table, fb.req_pool_indices[nd:], fb.prefix_lens[nd:],
                fb.extend_lens[nd:], fb.extend_start_loc[nd:], fb.max_extend_len, scale,
                window=spec.window, softcap=spec.softcap,
            )  # fmt: skip
        return out


_FULL = LayerAttention()
