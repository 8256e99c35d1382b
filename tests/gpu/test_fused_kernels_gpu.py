"""The fused Triton kernels at Llama-3-8B sizes on the GPU, in bf16 and fp16, against the torch code
they replace (models/llama.py's numerics, copied here as `ref_*`); and all four captured in one CUDA
graph, which fails if a wrapper synchronises with the host."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from kernel_refs import EPS, mismatch, ref_norm, ref_rope, ref_silu_and_mul, rel_err, rope_tables  # noqa: E402

from sglbus_kernels.activation import silu_and_mul  # noqa: E402
from sglbus_kernels.kv_store import store_kv  # noqa: E402
from sglbus_kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from sglbus_kernels.rope import rope_store_kv  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, DIM = 4096, 14336, 32, 8, 128
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
FLIPS = 1e-3  # elements allowed to round the other way (fp32 ulp-level differences)
DTYPES = list(TOL)


def qkv_views(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=dtype)
    q, k, v = qkv.split((HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM), dim=-1)
    return q.view(tokens, HEADS, DIM), k.view(tokens, KV_HEADS, DIM), v.view(tokens, KV_HEADS, DIM)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_norms(nan_empty, tokens, dtype):
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
    residual = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype) * 4
    weight = torch.randn(HIDDEN, device="cuda", dtype=dtype)
    out, ref = rms_norm(x, weight, EPS), ref_norm(x, weight)
    assert rel_err(out, ref) < TOL[dtype] and mismatch(out, ref) < FLIPS
    summed = x + residual
    out, _ = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(residual, summed), "the sum is rounded as torch rounds it"
    ref = ref_norm(summed, weight)
    assert rel_err(out, ref) < TOL[dtype] and mismatch(out, ref) < FLIPS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 4096])
def test_silu_and_mul(nan_empty, tokens, dtype):
    gate_up = torch.randn(tokens, 2 * INTER, device="cuda", dtype=dtype) * 4
    out = silu_and_mul(gate_up)
    assert rel_err(out, ref_silu_and_mul(gate_up)) < TOL[dtype]
    assert mismatch(out, ref_silu_and_mul(gate_up.float()).to(dtype)) < FLIPS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 4096])
def test_store_kv(tokens, dtype):
    slots = 3 * tokens + 5
    _, k, v = qkv_views(tokens, dtype)
    k_buf = torch.full((slots, KV_HEADS, DIM), float("nan"), device="cuda", dtype=dtype)
    v_buf = k_buf.clone()
    loc = torch.randperm(slots, device="cuda")[:tokens]
    store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    others = torch.ones(slots, dtype=torch.bool, device="cuda")
    others[loc] = False
    assert k_buf[others].isnan().all() and v_buf[others].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 4096])
def test_rope_store_kv(tokens, dtype):
    slots = 3 * tokens + 5
    cos, sin = rope_tables(DIM, 8192, "cuda")
    q, k, v = qkv_views(tokens, dtype)
    positions = torch.randint(1, 8192, (tokens,), device="cuda")
    loc = torch.randperm(slots, device="cuda")[:tokens]
    k_buf = torch.full((slots, KV_HEADS, DIM), float("nan"), device="cuda", dtype=dtype)
    v_buf = k_buf.clone()
    ref_q, ref_k, k_before = ref_rope(q, cos, sin, positions), ref_rope(k, cos, sin, positions), k.clone()
    exact_k = ref_rope(k.float(), cos, sin, positions).to(dtype)
    rope_store_kv(q, k, v, cos, sin, positions, k_buf, v_buf, loc)
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k_buf[loc], ref_k) < TOL[dtype]
    assert mismatch(k_buf[loc], exact_k) < FLIPS
    assert torch.equal(k, k_before) and torch.equal(v_buf[loc], v)


def test_cuda_graph_replay():
    tokens, dtype = 64, torch.bfloat16
    cos, sin = rope_tables(DIM, 8192, "cuda")
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device="cuda", dtype=dtype)
    gate_up = torch.randn(tokens, 2 * INTER, device="cuda", dtype=dtype)
    q, k, v = qkv_views(tokens, dtype)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    k_buf = torch.zeros(256, KV_HEADS, DIM, device="cuda", dtype=dtype)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(256, device="cuda")[:tokens]

    def step():
        out, _ = fused_add_rms_norm(x, residual, weight, EPS)
        rope_store_kv(q, k, v, cos, sin, positions, k_buf, v_buf, loc)
        return out, silu_and_mul(gate_up)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, act = step()
    for tensor in (x, residual, gate_up, q, k, v):
        tensor.normal_()
    positions.random_(0, 8192)
    summed, ref_q, ref_k = x + residual, ref_rope(q, cos, sin, positions), ref_rope(k, cos, sin, positions)
    graph.replay()
    assert rel_err(out, ref_norm(summed, weight)) < TOL[dtype]
    assert rel_err(act, ref_silu_and_mul(gate_up)) < TOL[dtype]
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k_buf[loc], ref_k) < TOL[dtype]
    assert torch.equal(v_buf[loc], v)
