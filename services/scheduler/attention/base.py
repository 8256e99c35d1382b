"""The attention-backend interface: every backend reads and writes the same token-level KV pool."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.memory import KVPool, ReqToTokenPool


class AttentionBackend(ABC):
    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int) -> None:
        self.kv, self.req_to_token = kv, req_to_token
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build per-step metadata (gather indices, masks) once; every layer reuses it via fb.attn."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the new tokens. Stores k/v at fb.out_cache_loc, attends over
        each request's whole sequence (cached prefix + new tokens, causal) and returns [T, H, D]."""
