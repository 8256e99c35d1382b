"""fused_moe (sglbus_kernels/fused_moe.py) against its per-expert torch loop, at tiny shapes under
Triton's interpreter (tests/conftest.py sets it without CUDA): 16-row tiles, so a few tokens already
span several blocks, leave experts empty, or fit in one partial block. Outputs start as NaN
(nan_empty), so a row the kernels fail to write shows up."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import rel_err  # noqa: E402

import sglbus_kernels.fused_moe as fused_moe_module  # noqa: E402
from sglbus_kernels.fused_moe import (  # noqa: E402
    MoEConfig,
    fused_moe,
    max_blocks,
    moe_align,
    moe_config,
    moe_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def routing(tokens: int, top_k: int, num_experts: int, skew: float = 0.0, seed: int = 0):
    """(topk_weights fp32 [T, K], topk_ids int64 [T, K]): distinct experts per token, drawn with
    probability ~ exp(-skew * e), so a large skew piles the pairs on the first experts."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.exp(-skew * torch.arange(num_experts, dtype=torch.float32)).expand(tokens, -1)
    ids = torch.multinomial(probs, top_k, replacement=False, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen).softmax(-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def expert_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype):
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, inter, device=DEVICE) / inter**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def check(x, w_gate_up, w_down, weights, ids, **kwargs):
    out = fused_moe(x, w_gate_up, w_down, weights, ids, **kwargs)
    ref = moe_reference(x, w_gate_up, w_down, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[x.dtype]
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens, top_k, num_experts, inter, skew",
    [
        (1, 1, 4, 16, 0.0),  # one pair: one partial block, three empty experts
        (3, 2, 8, 24, 0.0),  # T*K < BLOCK_M; I=24: partial K tile in GEMM 2, partial N tiles
        (20, 3, 4, 48, 0.0),  # ~15 pairs per expert: blocks cross expert boundaries
        (20, 2, 8, 16, 2.0),  # uneven: most pairs on experts 0 and 1 (several blocks), some empty
        (17, 1, 6, 32, 0.0),  # K=1: GEMM 2 writes the output directly
    ],
)
def test_fused_moe_matches_reference(nan_empty, tokens, top_k, num_experts, inter, skew, dtype):
    hidden = 32
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    w_gate_up, w_down = expert_weights(num_experts, hidden, inter, dtype)
    weights, ids = routing(tokens, top_k, num_experts, skew)
    out, ref = check(x, w_gate_up, w_down, weights, ids)
    if dtype == torch.float32:
        return
    # bf16: the only differences are fp32 ulp-level, so almost every element rounds the same way
    exact = moe_reference(x.float(), w_gate_up.float(), w_down.float(), weights, ids)
    assert rel_err(out.float(), exact) <= 2 * rel_err(ref.float(), exact) + 1e-3, "no worse than torch"


def test_all_tokens_on_one_expert(nan_empty):
    tokens, num_experts, hidden, inter = 19, 5, 32, 16
    x = torch.randn(tokens, hidden, device=DEVICE)
    w_gate_up, w_down = expert_weights(num_experts, hidden, inter, torch.float32)
    ids = torch.full((tokens, 1), 3, device=DEVICE)
    weights = torch.rand(tokens, 1, device=DEVICE)
    check(x, w_gate_up, w_down, weights, ids)
    # the same rows on expert 3 alone, as a plain matmul
    gate, up = (x @ w_gate_up[3].T).chunk(2, dim=-1)
    dense = weights * ((torch.nn.functional.silu(gate) * up) @ w_down[3].T)
    assert rel_err(fused_moe(x, w_gate_up, w_down, weights, ids), dense) < 1e-5


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int16, torch.int64])
def test_strided_x_and_id_dtypes(nan_empty, id_dtype):
    """x a column slice of a wider tensor (the model's views), ids in any int dtype, ids and weights
    non-contiguous (transposed)."""
    tokens, top_k, num_experts, hidden, inter = 9, 2, 6, 32, 16
    wide = torch.randn(tokens, 3 * hidden, device=DEVICE)
    x = wide[:, hidden : 2 * hidden]
    w_gate_up, w_down = expert_weights(num_experts, hidden, inter, torch.float32)
    weights, ids = routing(tokens, top_k, num_experts)
    ids_t, weights_t = ids.to(id_dtype).T.contiguous().T, weights.T.contiguous().T
    assert not ids_t.is_contiguous()
    out = fused_moe(x, w_gate_up, w_down, weights_t, ids_t)
    assert rel_err(out, moe_reference(x.contiguous(), w_gate_up, w_down, weights, ids)) < 1e-5


@pytest.mark.parametrize("block_m, group_m", [(16, 1), (32, 4)])
def test_configs_agree(nan_empty, block_m, group_m):
    """Other tiles (32-row blocks, a wider swizzle group) give the same answer."""
    tokens, top_k, num_experts, hidden, inter = 20, 3, 5, 32, 48
    x = torch.randn(tokens, hidden, device=DEVICE)
    w_gate_up, w_down = expert_weights(num_experts, hidden, inter, torch.float32)
    weights, ids = routing(tokens, top_k, num_experts, skew=1.0)
    check(x, w_gate_up, w_down, weights, ids, config=MoEConfig(block_m, 32, 16, group_m, 4, 1))


@pytest.mark.parametrize("rows_per_expert", [1, 20, 100, 1000])
def test_gpu_tiles(nan_empty, rows_per_expert):
    """The tile sets moe_config picks on a GPU (up to 128 x 128) compute the same, here at a shape
    smaller than one tile."""
    config = moe_config(rows_per_expert, 1, 1, torch.device("cuda"))
    x = torch.randn(12, 32, device=DEVICE)
    w_gate_up, w_down = expert_weights(6, 32, 24, torch.float32)
    weights, ids = routing(12, 2, 6, skew=1.0)
    check(x, w_gate_up, w_down, weights, ids, config=config)


def test_chunked_tokens(nan_empty, monkeypatch):
    """Inputs past _CHUNK_TOKENS run chunk by chunk, each aligned on its own, into their rows."""
    monkeypatch.setattr(fused_moe_module, "_CHUNK_TOKENS", 7)
    x = torch.randn(20, 32, device=DEVICE)
    w_gate_up, w_down = expert_weights(5, 32, 16, torch.float32)
    for top_k in (1, 2):
        weights, ids = routing(20, top_k, 5)
        check(x, w_gate_up, w_down, weights, ids)


def test_no_tokens():
    w_gate_up, w_down = expert_weights(4, 32, 16, torch.float32)
    x = torch.empty(0, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    assert fused_moe(x, w_gate_up, w_down, ids.float(), ids).shape == (0, 32)


def test_bad_shapes_are_refused():
    w_gate_up, w_down = expert_weights(4, 32, 16, torch.float32)
    x = torch.randn(3, 32, device=DEVICE)
    weights, ids = routing(3, 2, 4)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.to(torch.bfloat16), w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match="H=24"):
        fused_moe(x[:, :24], w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w_gate_up, w_down, weights[:, :1], ids)


@pytest.mark.parametrize(
    "tokens, top_k, num_experts, block_m, skew",
    [
        (1, 1, 8, 16, 0.0),
        (5, 3, 4, 16, 0.0),
        (40, 2, 8, 16, 3.0),
        (40, 8, 16, 32, 0.5),
        (7, 2, 128, 16, 0.0),
        (300, 4, 8, 16, 0.5),
    ],  # 82 blocks, 1312 rows: several steps of the plan kernel's loops
)
def test_align_invariants(tokens, top_k, num_experts, block_m, skew):
    """Every pair appears once, in a block of its own expert; padding rows hold the sentinel T*K;
    each expert's run is padded to a block; num_padded counts exactly the blocks in use."""
    _, ids = routing(tokens, top_k, num_experts, skew)
    sorted_ids, block_expert, num_padded = moe_align(ids.to(torch.int32), num_experts, block_m)
    num_pairs = tokens * top_k
    blocks = max_blocks(num_pairs, num_experts, block_m)
    assert sorted_ids.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).cpu()
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_padded) == padded <= blocks * block_m
    used = sorted_ids[:padded].long().cpu()
    assert (sorted_ids[padded:] == num_pairs).all(), "rows past num_padded are padding"
    real = used < num_pairs
    assert sorted(used[real].tolist()) == list(range(num_pairs)), "each pair exactly once"
    row_expert = block_expert.long().cpu().repeat_interleave(block_m)[:padded]
    assert torch.equal(row_expert[real], ids.reshape(-1).cpu()[used[real]]), "pairs in their expert's blocks"
    assert (row_expert.diff() >= 0).all(), "experts in order"
    for e in range(num_experts):
        assert int((row_expert == e).sum()) == (counts[e] + block_m - 1) // block_m * block_m


def compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("num_experts, block_m", [(3, 2), (4, 4), (5, 4)])
def test_max_blocks_is_the_worst_case(num_experts, block_m):
    """Over every split of the pairs among the experts, the blocks needed never exceed max_blocks,
    and some split needs exactly that many (so the buffers are no larger than they must be)."""
    for num_pairs in range(1, 13):
        worst = max(sum(-(-c // block_m) for c in counts) for counts in compositions(num_pairs, num_experts))
        assert worst == max_blocks(num_pairs, num_experts, block_m), (num_pairs, num_experts, block_m)
