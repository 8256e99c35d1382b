"""The fused Triton kernels against the torch code they replace (models/llama.py's numerics, copied
here as `ref_*`), at small odd sizes.

Without CUDA they run under Triton's interpreter on CPU tensors (set before triton is imported).
Outputs start as NaN, so an element a kernel fails to write shows up.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py set TRITON_INTERPRET=1 without CUDA


from kernel_refs import EPS, mismatch, ref_norm, ref_rope, ref_silu_and_mul, rel_err, rope_tables  # noqa: E402

from sglbus_kernels.activation import silu_and_mul  # noqa: E402
from sglbus_kernels.kv_store import store_kv  # noqa: E402
from sglbus_kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from sglbus_kernels.rope import rope_store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FLIPS = 1e-3  # bf16 elements allowed to round the other way (fp32 ulp-level differences)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 576])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_rms_norm(nan_empty, tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype) * 3
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    out, ref = rms_norm(x, weight, EPS), ref_norm(x, weight)
    assert rel_err(out, ref) < TOL[dtype]
    assert dtype == torch.float32 or mismatch(out, ref) < FLIPS, "rounds where torch rounds"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 576])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_fused_add_rms_norm(nan_empty, tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype) * 4
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    summed = x + residual
    out, res = fused_add_rms_norm(x, residual, weight, EPS)
    assert res is residual and torch.equal(residual, summed), "the sum is rounded as torch rounds it"
    ref = ref_norm(summed, weight)
    assert rel_err(out, ref) < TOL[dtype]
    assert dtype == torch.float32 or mismatch(out, ref) < FLIPS


def test_rms_norm_fp32_weight_promotes():
    x = torch.randn(3, 96, device=DEVICE).to(torch.bfloat16)
    weight = torch.randn(96, device=DEVICE)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32 and rel_err(out, ref_norm(x, weight)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [96, 576, 1500])  # 1500: two column blocks, the second partial
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_silu_and_mul(nan_empty, tokens, inter, dtype):
    gate_up = (torch.randn(tokens, 2 * inter, device=DEVICE) * 4).to(dtype)
    out = silu_and_mul(gate_up)
    assert rel_err(out, ref_silu_and_mul(gate_up)) < TOL[dtype]
    # torch rounds silu(gate) before the product; the kernel rounds once, as fp32 math then a cast
    assert dtype == torch.float32 or mismatch(out, ref_silu_and_mul(gate_up.float()).to(dtype)) < FLIPS


def fused_qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, fused: bool):
    """q [T, H, D], k and v [T, Hkv, D]: views split from one qkv tensor when `fused`, else contiguous."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = (x.view(tokens, -1, dim) for x in (q, k, v))
    return (q, k, v) if fused else (q.contiguous(), k.contiguous(), v.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_store_kv(tokens, dim, dtype):
    slots, kv_heads = 40, 3
    _, k, v = fused_qkv(tokens, 4, kv_heads, dim, dtype, fused=True)
    k_buf = torch.full((slots, kv_heads, dim), float("nan"), device=DEVICE, dtype=dtype)
    v_buf = k_buf.clone()
    loc = torch.randperm(slots, device=DEVICE)[:tokens]
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    others = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert k_buf[others].isnan().all() and v_buf[others].isnan().all(), "only the slots in loc change"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_rope_store_kv(tokens, dim, dtype, fused):
    """q rotated in place, k rotated into its slot (k itself unchanged), v copied to its slot."""
    slots, kv_heads = 40, 2
    cos, sin = rope_tables(dim, 4096, DEVICE)
    q, k, v = fused_qkv(tokens, 6, kv_heads, dim, dtype, fused)
    positions = torch.randint(1, 4096, (tokens,), device=DEVICE)
    loc = torch.randperm(slots - 1, device=DEVICE)[:tokens] + 1
    k_buf = torch.full((slots, kv_heads, dim), float("nan"), device=DEVICE, dtype=dtype)
    v_buf = k_buf.clone()
    ref_q, ref_k = ref_rope(q, cos, sin, positions), ref_rope(k, cos, sin, positions)
    # torch rounds cos, sin and each product to the dtype; the kernel rounds once, after fp32 math
    exact_q = ref_rope(q.float(), cos, sin, positions).to(dtype)
    exact_k = ref_rope(k.float(), cos, sin, positions).to(dtype)
    k_before, v_before = k.clone(), v.clone()
    rope_store_kv(q, k, v, cos, sin, positions, k_buf, v_buf, loc)
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k_buf[loc], ref_k) < TOL[dtype]
    assert dtype == torch.float32 or (mismatch(q, exact_q) < FLIPS and mismatch(k_buf[loc], exact_k) < FLIPS)
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "k and v, beside q, are untouched"
    assert torch.equal(v_buf[loc], v)
    others = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert k_buf[others].isnan().all() and v_buf[others].isnan().all(), "only the slots in loc change"
