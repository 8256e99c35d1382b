"""The attention-backend interface: every backend reads and writes the same token-level KV pool.

Per step the runner calls `prepare(fb)` once; the backend keeps what it plans (gather indices,
masks, kernel arguments) on itself, and every layer's `forward` reuses it. A backend that can run
inside a CUDA graph says so (`supports_cuda_graph`) and implements the two hooks: `init_cuda_graph`
allocates whatever its decode path needs for batches up to max_bs once, and `prepare` of a DECODE
batch then reads only the batch's device tensors (no host work that depends on their values), so
the graph runner calls it on its static batch before capture and replays it as is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.rotary import Rotary


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, beyond its q/k/v: the RoPE it rotates q and k by (None: none), its score
    scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5), its sliding window (a query
    at position i sees keys i - window < p <= i; 0: every earlier key) and logit soft-cap (scores
    become softcap * tanh(score / softcap); 0: none)."""

    rotary: Rotary | None = None
    scale: float | None = None
    window: int = 0
    softcap: float = 0.0


class AttentionBackend(ABC):
    supports_cuda_graph = False
    supports_cascade = False  # reads ForwardBatch.cascade (shared-prefix decode); others ignore it

    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int) -> None:
        self.kv, self.req_to_token = kv, req_to_token
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5  # unless the layer's spec says otherwise

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Plan this step's attention once; every layer reuses it."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        fb: ForwardBatch,
        spec: LayerAttention | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the new tokens. Rotates q and k by `spec.rotary` at
        fb.positions (RoPE; not at all without it), stores k/v at fb.out_cache_loc, attends over each
        request's whole sequence (cached prefix + new tokens, causal; within `spec.window`) and returns
        [T, H, D]. q, k and v may be views of one fused projection; the backend may overwrite them."""

    def init_cuda_graph(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot run inside a CUDA graph")
