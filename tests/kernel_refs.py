"""What the fused-kernel tests (tests/kernels on CPU, tests/gpu at real sizes) compare against: the
torch layer ops the kernels replace (`TorchOps`, transformers' numerics), error measures, and RoPE
tables built as the model builds them. (Their `nan_empty` fixture is in conftest.py.)"""

from __future__ import annotations

import torch

from services.scheduler.models.ops import TorchOps
from services.scheduler.rotary import rotate_half_rope

EPS = 1e-5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference magnitude."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "an output element was not written"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def mismatch(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The fraction of elements that differ at all (rounding flips from fp32 ulp-level differences)."""
    return (out != ref).float().mean().item()


def ref_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return TorchOps.rms_norm(x, weight, EPS)


def ref_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """models/llama.py's torch numerics for silu(gate) * up on a fused [gate | up] product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return rotate_half_rope(x, cos, sin, positions)


def rope_tables(dim: int, max_positions: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, dim] fp32, as services/scheduler/rotary.py's Rotary builds them
    (Llama-3's theta)."""
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos(), emb.sin()
