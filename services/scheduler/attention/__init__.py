"""Attention backends by name (`--attention-backend`). A backend is imported only when chosen, so
the torch reference never needs Triton.

    torch    torch SDPA over gathered KV: the CPU reference (and CI)
    triton   sglbus_kernels/ reading the pool in place: the default on CUDA, CUDA-graph capable

flashinfer is not built: its wheel and its dependencies cannot reach the lent GPU, so it could not be
tested there (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.scheduler.attention.base import AttentionBackend
from services.scheduler.memory import KVPool, ReqToTokenPool

Factory = Callable[[KVPool, ReqToTokenPool, int, int], AttentionBackend]


def _torch(*args) -> AttentionBackend:
    from services.scheduler.attention.torch_backend import TorchAttention

    return TorchAttention(*args)


def _triton(*args) -> AttentionBackend:
    from services.scheduler.attention.triton_backend import TritonAttention

    return TritonAttention(*args)


BACKENDS: dict[str, Factory] = {"torch": _torch, "triton": _triton}


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from: {', '.join(BACKENDS)}")
    return name


def create_backend(
    name: str, kv: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int
) -> AttentionBackend:
    return BACKENDS[resolve_backend_name(name, kv.device)](kv, req_to_token, num_heads, head_dim)
