"""The Triton attention kernels against a float64 torch reference, on CPU through Triton's interpreter.

Pools are random, each request's slots a random permutation (never contiguous), and slot 0 and every
unused slot hold NaN: a kernel that lets an unread key reach the result fails loudly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py set TRITON_INTERPRET=1 without CUDA


from sglbus_kernels.cascade_plan import CascadePlan, block_r  # noqa: E402
from sglbus_kernels.decode_attention import decode_attention, decode_scratch  # noqa: E402
from sglbus_kernels.extend_attention import extend_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen):
    """k_buf, v_buf with NaN wherever no request reads; req_to_token rows in shuffled order."""
    total = sum(seq_lens)
    num_slots = total + 7
    k_buf = torch.full((num_slots + 1, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_buf = k_buf.clone()
    slots = torch.randperm(num_slots, generator=gen)[:total] + 1
    k_buf[slots] = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf[slots] = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)]
    table = torch.zeros((len(seq_lens) + 2, max(seq_lens) + 5), dtype=torch.int64)
    for row, own in zip(rows.tolist(), torch.split(slots, list(seq_lens)), strict=True):
        table[row, : own.numel()] = own
    return k_buf.to(DEVICE), v_buf.to(DEVICE), table.to(DEVICE), rows.to(DEVICE)


def reference(q, k_buf, v_buf, table, rows, prefix_lens, extend_lens, scale, window=0, softcap=0.0):
    """float64 attention: request i's tokens (flat, in order) at positions prefix_i.. over its keys;
    with a window, position i sees keys p with i - window < p <= i; with a soft-cap, scores s become
    softcap * tanh(s / softcap)."""
    group = q.shape[1] // k_buf.shape[1]
    out, start = [], 0
    for row, prefix, ext in zip(rows.tolist(), prefix_lens, extend_lens, strict=True):
        idx = table[row, : prefix + ext]
        k = k_buf[idx].double().repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
        v = v_buf[idx].double().repeat_interleave(group, 1).transpose(0, 1)
        qi = q[start : start + ext].double().transpose(0, 1)  # [H, ext, D]
        scores = qi @ k.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(prefix, prefix + ext, device=q.device)[:, None]
        keys = torch.arange(prefix + ext, device=q.device)
        visible = keys <= pos
        if window:
            visible &= pos - keys < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
        start += ext
    return torch.cat(out)


def rel_err(out, ref):
    assert not out.isnan().any(), "some output elements were never written"
    return ((out.double() - ref).norm() / ref.norm()).item()


def hide_before(k_buf, v_buf, table, rows, firsts):
    """NaN into the K/V of each request's keys before firsts[i] (after the reference has read them):
    keys that no query's window reaches, which a windowed kernel must not read."""
    for row, first in zip(rows.tolist(), firsts, strict=True):
        idx = table[row, : max(first, 0)]
        k_buf[idx] = float("nan")
        v_buf[idx] = float("nan")


def run_decode(
    seq_lens, num_heads, num_kv_heads, head_dim, dtype, num_splits=4, seed=0, window=0, softcap=0.0, gain=1.0
):
    """gain scales q, so that scores reach where a soft-cap bends them."""
    gen = torch.Generator().manual_seed(seed)
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = (torch.randn(len(seq_lens), num_heads, head_dim, generator=gen) * gain).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scratch = decode_scratch(len(seq_lens) + 3, num_heads, head_dim, num_splits, DEVICE)
    scale = head_dim**-0.5
    positions = [n - 1 for n in seq_lens]
    ref = reference(q, k_buf, v_buf, table, rows, positions, [1] * len(seq_lens), scale, window, softcap)
    if window:
        hide_before(k_buf, v_buf, table, rows, [n - window for n in seq_lens])
    decode_attention(q, k_buf, v_buf, out, table, rows, lens, scratch, scale, window=window, softcap=softcap)
    return out, ref


# each GQA group (1; 3, padded rows masked; 4) and each head_dim (64; 80, padded columns masked) once,
# the two masks together in one case: they act on different axes of the tile
SHAPES = [(2, 2, 80), (6, 2, 80), (8, 2, 64)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim):
    # 1 key, one partial 16-key tile, several tiles per split, and a length that is no tile multiple
    out, ref = run_decode([1, 9, 70, 133, 16], num_heads, num_kv_heads, head_dim, torch.float32)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_decode_bf16():
    out, ref = run_decode([1, 40, 97], 9, 3, 64, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_decode_more_splits_than_blocks():
    # 16 splits of whole 16-key tiles: most splits of these short requests are empty
    out, ref = run_decode([1, 3, 17, 40], 4, 1, 64, torch.float32, num_splits=16)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_one_split_writes_the_output_directly(dtype):
    # one split (a large batch on a GPU): stage 1 writes out itself, no combine
    out, ref = run_decode([1, 9, 70, 133], 6, 2, 80, dtype, num_splits=1)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_with_one_split_zeroes_an_empty_row_and_writes_strided_out_over_q():
    gen = torch.Generator().manual_seed(3)
    k_buf, v_buf, table, rows = make_pool([20, 20], 2, 64, torch.float32, gen)
    qkv = torch.randn(2, 8, 64, generator=gen).to(DEVICE)
    q = qkv[:, :4]
    ref = reference(q[1:].clone(), k_buf, v_buf, table, rows[1:], [19], [1], 0.125)
    lens = torch.tensor([0, 20], device=DEVICE)
    rest = qkv[:, 4:].clone()
    # out is q itself, as the model calls it: each program reads its heads before it writes them
    decode_attention(q, k_buf, v_buf, q, table, rows, lens, decode_scratch(2, 4, 64, 1, DEVICE), 0.125)
    assert torch.equal(q[0], torch.zeros_like(q[0]))
    assert rel_err(q[1:], ref) < TOL[torch.float32]
    assert torch.equal(qkv[:, 4:], rest)  # the heads past q are not written


def test_decode_empty_row_is_zero_and_harmless():
    gen = torch.Generator().manual_seed(1)
    k_buf, v_buf, table, rows = make_pool([20, 20], 2, 64, torch.float32, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor([0, 20], device=DEVICE)  # int64 lengths work as well as int32
    decode_attention(q, k_buf, v_buf, out, table, rows, lens, decode_scratch(2, 4, 64, 4, DEVICE), 0.125)
    ref = reference(q[1:], k_buf, v_buf, table, rows[1:], [19], [1], 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], ref) < TOL[torch.float32]


def test_decode_reads_strided_q_and_writes_strided_out():
    # q as the caller often has it: a view into a fused qkv projection
    gen = torch.Generator().manual_seed(2)
    seq_lens = [5, 33]
    k_buf, v_buf, table, rows = make_pool(seq_lens, 2, 64, torch.float32, gen)
    qkv = torch.randn(2, 8, 64, generator=gen).to(DEVICE)
    q, out = qkv[:, :6], torch.full((2, 6, 128), float("nan"), device=DEVICE)[..., :64]
    lens = torch.tensor(seq_lens, device=DEVICE)
    decode_attention(q, k_buf, v_buf, out, table, rows, lens, decode_scratch(2, 6, 64, 4, DEVICE), 0.125)
    assert rel_err(out, reference(q, k_buf, v_buf, table, rows, [4, 32], [1, 1], 0.125)) < 1e-4


def cascade_plan(groups, batch, group_size):
    """A CascadePlan by hand: groups = [(prefix_len, [batch indices])], tiles of block_r members."""
    br = block_r(torch.device(DEVICE), group_size)
    starts, members, first, count, length, rows = [0] * batch, [], [], [], [], []
    for prefix, idx in groups:
        for i in idx:
            starts[i] = prefix
        for a in range(0, len(idx), br):
            first.append(len(members))
            count.append(len(idx[a : a + br]))
            length.append(prefix)
            rows.append(idx[a])  # the test's row lookup: replaced by the table row below
            members.extend(idx[a : a + br])
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return CascadePlan(t(starts), t(members), t(first), t(count), t(length), t(rows), len(first), br)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,softcap", [(8, 2, 0.0), (4, 4, 0.0), (6, 2, 0.0), (8, 2, 1.0)]
)
def test_decode_with_shared_prefixes_matches_reference(num_heads, num_kv_heads, softcap):
    # two groups (6 members over a 37-token prefix: two tiles of block_r 4, the second partial, or one
    # partial tile of 16 for a GQA group of 1; 3 over 20) and two loners; the members' rows hold the
    # same slots for the prefix, as the radix cache hands them out; their own keys after the prefix:
    # 1, one whole 16-key tile, a tile and a part
    seq_lens = [40, 38, 60, 37 + 16, 45, 50, 25, 21, 22, 33, 5]
    groups = [(37, [0, 1, 2, 3, 4, 5]), (20, [6, 7, 8])]
    gen = torch.Generator().manual_seed(5)
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, 64, torch.float32, gen)
    for prefix, idx in groups:
        table[rows[idx[1:]], :prefix] = table[rows[idx[0]], :prefix]
    plan = cascade_plan(groups, len(seq_lens), num_heads // num_kv_heads)
    plan = CascadePlan(plan.kv_starts, plan.members, plan.tile_first, plan.tile_count, plan.tile_len,
                       rows[plan.tile_row], plan.num_tiles, plan.block_r)  # fmt: skip
    q = torch.randn(len(seq_lens), num_heads, 64, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    scratch = decode_scratch(len(seq_lens), num_heads, 64, 4, DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_buf, v_buf, out, table, rows, lens, scratch, 0.125, plan, softcap=softcap)
    positions = [n - 1 for n in seq_lens]
    ref = reference(q, k_buf, v_buf, table, rows, positions, [1] * len(seq_lens), 0.125, softcap=softcap)
    assert rel_err(out, ref) < TOL[torch.float32]
    plain = torch.full_like(q, float("nan"))
    decode_attention(q, k_buf, v_buf, plain, table, rows, lens, scratch, 0.125, softcap=softcap)
    assert (out - plain).abs().max().item() < 1e-5


def run_extend(
    prefix_lens,
    extend_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    seed=0,
    window=0,
    softcap=0.0,
    gain=1.0,
):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = (torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen) * gain).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    ext = torch.tensor(extend_lens, device=DEVICE)
    starts = torch.cumsum(ext, 0) - ext
    prefix = torch.tensor(prefix_lens, device=DEVICE)
    scale = head_dim**-0.5
    ref = reference(q, k_buf, v_buf, table, rows, prefix_lens, extend_lens, scale, window, softcap)
    if window:  # the first new token's window reaches furthest back
        hide_before(k_buf, v_buf, table, rows, [p - window + 1 for p in prefix_lens])
    extend_attention(
        q, out, k_buf, v_buf, table, rows, prefix, ext, starts, max(extend_lens), scale,
        window=window, softcap=softcap,
    )  # fmt: skip
    return out, ref


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_extend_matches_reference(num_heads, num_kv_heads, head_dim):
    # a plain prefill over several q blocks, prefix hits (tile-aligned and not), a single new token
    out, ref = run_extend([0, 23, 0, 32], [37, 5, 1, 18], num_heads, num_kv_heads, head_dim, torch.float32)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_extend_bf16():
    out, ref = run_extend([0, 45], [40, 20], 9, 3, 64, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_extend_skips_requests_with_no_new_tokens():
    # a request with no new tokens has no rows in q; the others' rows still come out right
    out, ref = run_extend([3, 10, 0], [4, 0, 9], 4, 2, 64, torch.float32)
    assert rel_err(out, ref) < TOL[torch.float32]


# sliding window and soft-cap. Windows below every length, at one (40), above all; 16-key tiles, so a
# window of 5 leaves the later rows of a 16-row extend block nothing in its first key tile. Keys outside
# every window hold NaN when the kernel runs (hide_before): reading them fails the test.
WINDOW_SHAPES = [(4, 2, 32), (3, 3, 16)]  # a GQA group of 2; none, at head_dim 16


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", WINDOW_SHAPES)
@pytest.mark.parametrize("window", [1, 17, 40, 200])
def test_decode_sliding_window(window, num_heads, num_kv_heads, head_dim):
    out, ref = run_decode([1, 9, 40, 70, 81], num_heads, num_kv_heads, head_dim, torch.float32, window=window)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 16])
def test_decode_sliding_window_over_one_or_many_splits(num_splits):
    # one split writes out directly; 16 splits of the window's 24 keys leave most of them empty
    out, ref = run_decode([1, 24, 25, 80], 4, 2, 32, torch.float32, num_splits=num_splits, window=24)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_softcap(dtype):
    # scores of a few units against a cap of 2: the cap bends most of them
    out, ref = run_decode([1, 9, 40, 81], 4, 2, 32, dtype, softcap=2.0, gain=3.0)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_softcap_saturates_without_overflow():
    # scores in the hundreds: exp(2 s / cap) overflows to inf, tanh must still come out +-1
    out, ref = run_decode([9, 81], 4, 2, 32, torch.float32, softcap=5.0, gain=100.0)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_softcap_in_a_window(dtype):
    out, ref = run_decode([1, 30, 81], 6, 2, 16, dtype, window=20, softcap=2.0, gain=3.0)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_rejects_a_window_with_a_cascade():
    gen = torch.Generator().manual_seed(0)
    k_buf, v_buf, table, rows = make_pool([20, 20], 2, 32, torch.float32, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    plan = cascade_plan([(16, [0, 1])], 2, 2)
    scratch = decode_scratch(2, 4, 32, 4, DEVICE)
    lens = torch.tensor([20, 20], device=DEVICE)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, k_buf, v_buf, q, table, rows, lens, scratch, 0.125, plan, window=8)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", WINDOW_SHAPES)
@pytest.mark.parametrize("window", [5, 20, 100])
def test_extend_sliding_window(window, num_heads, num_kv_heads, head_dim):
    # a prefill of 4 q blocks; prefix hits whose windows cross into the prefix, tile-aligned and not;
    # a single new token
    prefix_lens, extend_lens = [0, 23, 32, 40], [50, 30, 20, 1]
    out, ref = run_extend(
        prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim, torch.float32, window=window
    )
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_softcap(dtype):
    out, ref = run_extend([0, 23], [37, 20], 4, 2, 32, dtype, softcap=2.0, gain=3.0)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_softcap_in_a_window(dtype):
    out, ref = run_extend([0, 30], [45, 20], 6, 2, 16, dtype, window=12, softcap=2.0, gain=3.0)
    assert rel_err(out, ref) < TOL[dtype]
