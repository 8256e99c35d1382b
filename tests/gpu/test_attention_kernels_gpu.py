"""The Triton attention kernels at real sizes on the GPU (bf16, fp16, fp32) against float32 torch SDPA.

Llama-3-8B's heads (32 q, 8 kv, head_dim 128) and the default model's (9 q, 3 kv, head_dim 64); pools
with shuffled slots, NaN in every slot nobody reads. Also: decode captured in a CUDA graph and replayed
over new lengths, with graph-padding rows (seq_len 1 at slot 0) beside the real ones. Sliding windows
(Mistral's 4096, Gemma 3's 1024) and Gemma 2's logit soft-cap at head_dim 128 and 256, with the keys
outside every window NaN when the kernels run.
"""

from __future__ import annotations

import pytest
import torch

# skip before the import: importing the kernels here would fix them as compiled, and a CPU session's
# tests/kernels needs them interpreted
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from sglbus_kernels.cascade_plan import CascadePlan, block_r  # noqa: E402
from sglbus_kernels.decode_attention import DEFAULT_KV_SPLITS, decode_attention, decode_scratch  # noqa: E402
from sglbus_kernels.extend_attention import extend_attention  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(32, 8, 128), (9, 3, 64)]  # (q heads, kv heads, head_dim)


def make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen):
    total = sum(seq_lens)
    num_slots = total + 100
    k_buf = torch.full((num_slots + 1, num_kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    v_buf = k_buf.clone()
    slots = torch.randperm(num_slots, generator=gen, device="cuda")[:total] + 1
    k_buf[slots] = torch.randn(total, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v_buf[slots] = torch.randn(total, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    rows = torch.randperm(len(seq_lens) + 4, generator=gen, device="cuda")[: len(seq_lens)]
    table = torch.zeros((len(seq_lens) + 4, max(seq_lens) + 8), dtype=torch.int64, device="cuda")
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    for i, row in enumerate(rows.tolist()):
        table[row, : seq_lens[i]] = slots[starts[i] : starts[i + 1]]
    return k_buf, v_buf, table, rows


def reference(q, k_buf, v_buf, table, rows, prefix_lens, extend_lens, scale, window=0, softcap=0.0):
    """float32 SDPA per request, causal with the cached prefix as offset; a window hides keys p
    <= i - window from position i; a soft-cap (scores softcap * tanh(s / softcap)) computes the
    scores by hand, as SDPA cannot cap them."""
    group = q.shape[1] // k_buf.shape[1]
    out, start = [], 0
    for row, prefix, ext in zip(rows.tolist(), prefix_lens, extend_lens, strict=True):
        idx = table[row, : prefix + ext]
        k = k_buf[idx].float().transpose(0, 1)
        v = v_buf[idx].float().transpose(0, 1)
        qi = q[start : start + ext].float().transpose(0, 1)
        pos = torch.arange(prefix, prefix + ext, device="cuda")[:, None]
        keys = torch.arange(prefix + ext, device="cuda")
        mask = (keys <= pos) & ((pos - keys < window) if window else True)
        if softcap:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            scores = softcap * torch.tanh(qi @ k.transpose(1, 2) * scale / softcap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1
            )
        out.append(o.transpose(0, 1))
        start += ext
    return torch.cat(out)


def rel_err(out, ref):
    assert not out.isnan().any(), "some output elements were never written"
    return ((out.float() - ref).norm() / ref.norm()).item()


def hide_before(k_buf, v_buf, table, rows, firsts):
    """NaN into each request's K/V before key firsts[i] (after the reference read them): keys outside
    every window, which the kernels must not read."""
    for row, first in zip(rows.tolist(), firsts, strict=True):
        idx = table[row, : max(first, 0)]
        k_buf[idx] = float("nan")
        v_buf[idx] = float("nan")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_decode(num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    seq_lens = [1, 63, 64, 65, 511, 2049, 8191] + torch.randint(
        1, 3000, (57,), generator=gen, device="cuda"
    ).tolist()
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    scratch = decode_scratch(len(seq_lens), num_heads, head_dim, DEFAULT_KV_SPLITS, "cuda")
    lens = torch.tensor(seq_lens, device="cuda")
    scale = head_dim**-0.5
    decode_attention(q, k_buf, v_buf, out, table, rows, lens, scratch, scale)
    ref = reference(q, k_buf, v_buf, table, rows, [n - 1 for n in seq_lens], [1] * len(seq_lens), scale)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_extend(num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator("cuda").manual_seed(1)
    prefix_lens = [0, 1024, 0, 77, 300, 4096, 0, 128]
    extend_lens = [256, 256, 1, 500, 129, 64, 1000, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    ext = torch.tensor(extend_lens, device="cuda")
    starts = torch.cumsum(ext, 0) - ext
    scale = head_dim**-0.5
    prefix = torch.tensor(prefix_lens, device="cuda")
    extend_attention(q, out, k_buf, v_buf, table, rows, prefix, ext, starts, max(extend_lens), scale)
    ref = reference(q, k_buf, v_buf, table, rows, prefix_lens, extend_lens, scale)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype,softcap", [(d, 0.0) for d in DTYPES] + [(torch.bfloat16, 50.0)])
def test_decode_with_a_shared_prefix(dtype, softcap):
    """The cascade path at serving sizes: 40 of 48 requests over one 1500-token cached prefix; with
    Gemma 2's soft-cap too (q scaled up so the cap bends the scores)."""
    gen = torch.Generator("cuda").manual_seed(3)
    num_heads, num_kv_heads, head_dim, prefix = 32, 8, 128, 1500
    seq_lens = [prefix + 1 + i * 7 for i in range(40)] + [1, 30, 600, 2000, 64, 65, 3000, 9]
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen)
    table[rows[1:40], :prefix] = table[rows[0], :prefix]
    br = block_r(torch.device("cuda"), num_heads // num_kv_heads)
    members = list(range(40))
    tiles = list(range(0, 40, br))
    t = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    plan = CascadePlan(t([prefix] * 40 + [0] * 8), t(members), t(tiles), t([min(br, 40 - a) for a in tiles]),
                       t([prefix] * len(tiles)), rows[t(tiles)], len(tiles), br)  # fmt: skip
    gain = CAP_GAIN if softcap else 1.0
    q = (torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device="cuda") * gain).to(dtype)
    out = torch.full_like(q, float("nan"))
    scratch = decode_scratch(len(seq_lens), num_heads, head_dim, DEFAULT_KV_SPLITS, "cuda")
    lens = torch.tensor(seq_lens, device="cuda")
    scale = head_dim**-0.5
    decode_attention(q, k_buf, v_buf, out, table, rows, lens, scratch, scale, plan, softcap=softcap)
    positions = [n - 1 for n in seq_lens]
    ref = reference(q, k_buf, v_buf, table, rows, positions, [1] * len(seq_lens), scale, softcap=softcap)
    assert rel_err(out, ref) < TOL[dtype]


CAP_GAIN = 30.0
WINDOW_SHAPES = [(32, 8, 128), (16, 8, 256)]
WINDOW_CASES = [(4096, 0.0), (0, 50.0), (1024, 50.0)]  # (window, softcap)


@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", WINDOW_SHAPES)
def test_decode_window_softcap(num_heads, num_kv_heads, head_dim, window, softcap):
    gen = torch.Generator("cuda").manual_seed(4)
    dtype = torch.bfloat16
    seq_lens = [1, 64, 1023, 1024, 1025, 4095, 4096, 4097, 9000] + torch.randint(
        1, 6000, (23,), generator=gen, device="cuda"
    ).tolist()
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen)
    gain = CAP_GAIN if softcap else 1.0
    q = (torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device="cuda") * gain).to(dtype)
    out = torch.full_like(q, float("nan"))
    scratch = decode_scratch(len(seq_lens), num_heads, head_dim, DEFAULT_KV_SPLITS, "cuda")
    lens = torch.tensor(seq_lens, device="cuda")
    scale = head_dim**-0.5
    positions = [n - 1 for n in seq_lens]
    ref = reference(q, k_buf, v_buf, table, rows, positions, [1] * len(seq_lens), scale, window, softcap)
    if window:
        hide_before(k_buf, v_buf, table, rows, [n - window for n in seq_lens])
    decode_attention(q, k_buf, v_buf, out, table, rows, lens, scratch, scale, window=window, softcap=softcap)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", WINDOW_SHAPES)
def test_extend_window_softcap(num_heads, num_kv_heads, head_dim, window, softcap):
    gen = torch.Generator("cuda").manual_seed(5)
    dtype = torch.bfloat16
    # a prefill longer than the window; prefix hits whose windows reach into the prefix; one new token
    prefix_lens = [0, 4000, 0, 900, 6000, 77]
    extend_lens = [5000, 300, 1, 500, 129, 2000]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    k_buf, v_buf, table, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype, gen)
    gain = CAP_GAIN if softcap else 1.0
    q = (torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen, device="cuda") * gain).to(dtype)
    out = torch.full_like(q, float("nan"))
    ext = torch.tensor(extend_lens, device="cuda")
    starts = torch.cumsum(ext, 0) - ext
    scale = head_dim**-0.5
    prefix = torch.tensor(prefix_lens, device="cuda")
    ref = reference(q, k_buf, v_buf, table, rows, prefix_lens, extend_lens, scale, window, softcap)
    if window:
        hide_before(k_buf, v_buf, table, rows, [p - window + 1 for p in prefix_lens])
    extend_attention(
        q, out, k_buf, v_buf, table, rows, prefix, ext, starts, max(extend_lens), scale,
        window=window, softcap=softcap,
    )  # fmt: skip
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("num_heads,head_dim,window,softcap", [(32, 128, 0, 0.0), (16, 256, 1024, 50.0)])
def test_decode_replays_in_a_cuda_graph(num_heads, head_dim, window, softcap):
    """A captured graph follows new lengths (a window's start is computed in the kernels from seq_len)."""
    gen = torch.Generator("cuda").manual_seed(6)
    num_kv_heads, dtype = 8, torch.bfloat16
    k_buf, v_buf, table, rows = make_pool([3000] * 6, num_kv_heads, head_dim, dtype, gen)
    batch = 8  # 6 real rows, 2 padding rows at slot 0
    gain = CAP_GAIN if softcap else 1.0
    q = (torch.randn(batch, num_heads, head_dim, generator=gen, device="cuda") * gain).to(dtype)
    out = torch.empty_like(q)
    pool_idx = torch.cat((rows, torch.zeros(2, dtype=torch.int64, device="cuda")))
    lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    scratch = decode_scratch(batch, num_heads, head_dim, DEFAULT_KV_SPLITS, "cuda")
    scale = head_dim**-0.5
    run = lambda: decode_attention(
        q, k_buf, v_buf, out, table, pool_idx, lens, scratch, scale, window=window, softcap=softcap
    )
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for real in ([5, 900, 1024, 1025, 2999, 3000], [3000, 17, 2048, 128, 2, 640]):
        lens.copy_(torch.tensor(real + [1, 1]))
        out.fill_(float("nan"))
        graph.replay()
        positions = [n - 1 for n in real]
        ref = reference(q, k_buf, v_buf, table, rows, positions, [1] * 6, scale, window, softcap)
        assert rel_err(out[:6], ref) < TOL[dtype]
