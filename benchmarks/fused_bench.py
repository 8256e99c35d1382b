"""The fused Triton kernels (sglbus_kernels/) against the torch ops they replace, on the GPU, at Llama-3-8B
sizes in bf16: median time of triton.testing.do_bench and the bandwidth of the bytes the fused kernel
must move (the same byte count for both columns, so GB/s compares like with like).

    python -m benchmarks.fused_bench
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, INTER, HEADS, KV_HEADS, DIM, EPS = 4096, 14336, 32, 8, 128, 1e-5
TOKENS = (1, 256, 1024, 8192)
DTYPE = torch.bfloat16


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def torch_rope(q, k, cos, sin, positions):
    c, s = cos[positions].unsqueeze(1).to(q.dtype), sin[positions].unsqueeze(1).to(q.dtype)
    half = DIM // 2

    def rot(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


def cases(t: int) -> list[tuple[str, Callable, Callable, int]]:
    """(name, torch version, fused version, bytes the fused kernel reads and writes) at t tokens."""
    from sglbus_kernels.activation import silu_and_mul
    from sglbus_kernels.kv_store import store_kv
    from sglbus_kernels.norm import fused_add_rms_norm, rms_norm
    from sglbus_kernels.rope import rope_store_kv

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=DTYPE)

    x, residual, weight, gate_up = randn(t, HIDDEN), randn(t, HIDDEN), randn(HIDDEN), randn(t, 2 * INTER)
    qkv = randn(t, (HEADS + 2 * KV_HEADS) * DIM)
    q, k, v = qkv.split((HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM), dim=-1)
    q, k, v = q.view(t, HEADS, DIM), k.view(t, KV_HEADS, DIM), v.view(t, KV_HEADS, DIM)
    freqs = torch.randn(8192, DIM // 2, device="cuda").repeat(1, 2)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 8192, (t,), device="cuda")
    k_buf, v_buf = randn(65536, KV_HEADS, DIM), randn(65536, KV_HEADS, DIM)
    loc = torch.randperm(65536, device="cuda")[:t]

    def torch_add_norm():
        r = residual + x
        return torch_rms_norm(r, weight), r

    def torch_store():
        k_buf[loc] = k
        v_buf[loc] = v

    def torch_silu():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    row = t * HIDDEN * 2
    rope_bytes = 2 * t * (HEADS + KV_HEADS) * DIM * 2 + 2 * t * (DIM // 2) * 4
    return [
        ("rms_norm", lambda: torch_rms_norm(x, weight), lambda: rms_norm(x, weight, EPS), 2 * row),
        ("fused_add_rms_norm", torch_add_norm, lambda: fused_add_rms_norm(x, residual, weight, EPS), 4 * row),
        ("silu_and_mul", torch_silu, lambda: silu_and_mul(gate_up), 3 * t * INTER * 2),
        ("store_kv", torch_store, lambda: store_kv(k_buf, v_buf, loc, k, v), 4 * t * KV_HEADS * DIM * 2),
        ("rope_store_kv", lambda: (torch_rope(q, k, cos, sin, positions), torch_store()),
         lambda: rope_store_kv(q, k, v, cos, sin, positions, k_buf, v_buf, loc),
         rope_bytes + 2 * t * KV_HEADS * DIM * 2),
    ]  # fmt: skip


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("fused_bench needs a CUDA GPU")
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}, {DTYPE}, median of triton.testing.do_bench")
    head = ("kernel", "T", "torch ms", "triton ms", "speedup", "torch GB/s", "triton GB/s")
    print(
        "".join(f"{h:<20}" if i == 0 else f"{h:>{(6, 11, 11, 9, 12, 12)[i - 1]}}" for i, h in enumerate(head))
    )
    for t in TOKENS:
        for name, ref, fused, nbytes in cases(t):
            ms_ref = do_bench(ref, warmup=10, rep=40, return_mode="median")
            ms_fused = do_bench(fused, warmup=10, rep=40, return_mode="median")
            print(
                f"{name:<20}{t:>6}{ms_ref:>11.4f}{ms_fused:>11.4f}{ms_ref / ms_fused:>8.2f}x"
                f"{nbytes / ms_ref / 1e6:>12.0f}{nbytes / ms_fused / 1e6:>12.0f}"
            )


if __name__ == "__main__":
    main()
