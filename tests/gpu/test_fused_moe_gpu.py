"""fused_moe at the MoE layer shapes of Qwen3-30B-A3B and Mixtral-8x7B on the GPU, in bf16 and fp16,
against the per-expert torch loop (moe_reference) and an fp32 ground truth; and inside a CUDA graph,
captured once and replayed with new routings (which fails if the align step reads a device value on
the host or sizes a buffer by the routing)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from kernel_refs import rel_err  # noqa: E402

from sglbus_kernels.fused_moe import fused_moe, moe_reference  # noqa: E402

# (experts, top_k, hidden, intermediate)
QWEN3_30B = (128, 8, 2048, 768)
MIXTRAL = (8, 2, 4096, 14336)
# of the largest output: the paths round at different steps, and the largest elements differ by up
# to 2-3 ulps (bf16: 0.4% each); "no worse than torch" against fp32 is the sharper check
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def layer(shape, dtype):
    num_experts, _, hidden, inter = shape
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda") / hidden**0.5
    w_down = torch.randn(num_experts, hidden, inter, device="cuda") / inter**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def route(tokens: int, shape, skew: float = 0.0):
    """Softmax top-k of random router logits, renormalised (as Qwen3 and Mixtral do); `skew` favours
    the low expert ids, for uneven loads."""
    num_experts, top_k = shape[0], shape[1]
    logits = torch.randn(tokens, num_experts, device="cuda") - skew * torch.arange(num_experts, device="cuda")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def piled(tokens: int, shape):
    """Every token on experts 0 .. K-1: the fewest experts, the most rows each."""
    top_k = shape[1]
    ids = torch.arange(top_k, device="cuda").expand(tokens, top_k)
    return torch.rand(tokens, top_k, device="cuda").softmax(-1), ids


def exact(x, w_gate_up, w_down, weights, ids):
    return moe_reference(x.float(), w_gate_up.float(), w_down.float(), weights, ids)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "shape, tokens",
    # token counts reach each tile branch of moe_config (mean rows per expert < 12, < 48, < 160, more)
    [(QWEN3_30B, 1), (QWEN3_30B, 7), (QWEN3_30B, 200), (QWEN3_30B, 1000), (QWEN3_30B, 4096),
     (MIXTRAL, 1), (MIXTRAL, 33), (MIXTRAL, 300), (MIXTRAL, 2048)],
)  # fmt: skip
def test_fused_moe_matches_reference(nan_empty, shape, tokens, dtype):
    torch.manual_seed(tokens)
    w_gate_up, w_down = layer(shape, dtype)
    x = torch.randn(tokens, shape[2], device="cuda", dtype=dtype)
    weights, ids = route(tokens, shape, skew=0.05 if tokens > 100 else 0.0)
    out = fused_moe(x, w_gate_up, w_down, weights, ids.to(torch.int32))
    ref = moe_reference(x, w_gate_up, w_down, weights, ids)
    assert rel_err(out, ref) < TOL[dtype]
    truth = exact(x, w_gate_up, w_down, weights, ids)
    assert rel_err(out.float(), truth) <= 2 * rel_err(ref.float(), truth) + 1e-4, "no worse than torch"


def test_chunked_tokens(nan_empty):
    """More tokens than one chunk (8192): the chunks' outputs land in their rows."""
    w_gate_up, w_down = layer(QWEN3_30B, torch.bfloat16)
    x = torch.randn(8192 + 77, QWEN3_30B[2], device="cuda", dtype=torch.bfloat16)
    weights, ids = route(x.shape[0], QWEN3_30B)
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    assert rel_err(out, moe_reference(x, w_gate_up, w_down, weights, ids)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("shape, tokens", [(QWEN3_30B, 1), (QWEN3_30B, 64), (MIXTRAL, 16)])
def test_cuda_graph_replay(shape, tokens):
    """Capture once, replay with routings unlike the captured one: uniform, all on experts
    0 .. K-1, skewed; each with a new x."""
    dtype = torch.bfloat16
    w_gate_up, w_down = layer(shape, dtype)
    x = torch.randn(tokens, shape[2], device="cuda", dtype=dtype)
    weights, ids = route(tokens, shape)
    ids = ids.to(torch.int32)
    fused_moe(x, w_gate_up, w_down, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w_gate_up, w_down, weights, ids)
    for name, routing in (("uniform", route(tokens, shape)), ("piled", piled(tokens, shape)),
                          ("skewed", route(tokens, shape, skew=0.3))):  # fmt: skip
        x.normal_()
        weights.copy_(routing[0])
        ids.copy_(routing[1])
        graph.replay()
        ref = moe_reference(x, w_gate_up, w_down, weights, ids)
        assert rel_err(out, ref) < TOL[dtype], f"replay with the {name} routing"
