"""The Triton attention kernels on the GPU at serving sizes: checked against torch, then timed.

Each shape first runs once against a float32 SDPA reference (relative error ||out - ref|| / ||ref||),
then is timed twice, medians in ms: "eager" with triton.testing.do_bench (a cold L2 each call, and the
Python launch of the kernels included: at small sizes that launch is most of it), "graph" as replays
of a CUDA graph, the way the engine runs decode (back to back, so data under the 60 MB L2 stays
there). KV pools hold each request's slots in a random permutation, the worst case for the gathers.
"KV GB/s" (from the graph time) counts the K and V bytes of every request's keys once; "floor" is that
traffic at 4.25 TB/s, the H200's copy bandwidth, so "% floor" near 100 means bandwidth-bound at the
hardware's limit. Extend also gives TFLOP/s of the causal QK^T and PV products. The cascade rows time
the shared-prefix path against the plain decode kernel on the same requests (its error is against the
plain kernel's output; its KV GB/s counts every request's keys, so above the floor means it read less).

    python -m benchmarks.kernel_bench            # Llama-3-8B heads (32 q, 8 kv, head_dim 128), bf16
    python -m benchmarks.kernel_bench --heads 9 --kv-heads 3 --head-dim 64
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from sglbus_kernels.cascade_plan import CascadePlan, block_r
from sglbus_kernels.decode_attention import DEFAULT_KV_SPLITS, decode_attention, decode_scratch
from sglbus_kernels.extend_attention import extend_attention

FLOOR_BYTES_PER_S = 4.25e12
DECODE_SHAPES = [(1, 512), (64, 512), (256, 512), (1024, 512), (32, 8192)]  # (batch, seq_len)
EXTEND_SHAPES = [(8, 256, 0), (8, 256, 1024)]  # (requests, new tokens each, cached prefix)
# (groups, members each, shared prefix, own tokens): the generated-shared-prefix workload's decode
CASCADE_SHAPES = [(8, 64, 1024, 128), (1, 256, 4096, 64), (32, 8, 512, 64)]


@dataclass
class Row:
    shape: str
    err: float  # relative to the float32 reference
    eager_ms: float
    graph_ms: float
    kv_bytes: int
    flops: int | None = None

    def line(self) -> str:
        ms = self.graph_ms
        floor_ms = self.kv_bytes / FLOOR_BYTES_PER_S * 1e3
        gbps = self.kv_bytes / ms / 1e6
        tflops = f"{self.flops / ms / 1e9:8.1f}" if self.flops else ""
        return (
            f"{self.shape:<28} {self.err:8.1e} {self.eager_ms:9.4f} {ms:9.4f} {gbps:8.0f} "
            f"{floor_ms:9.4f} {100 * floor_ms / ms:7.0f}% {tflops}"
        )


HEADER = (
    f"{'shape':<28} {'rel err':>8} {'eager ms':>9} {'graph ms':>9} {'KV GB/s':>8} {'floor ms':>9} "
    f"{'% floor':>8} {'TFLOP/s':>8}"
)


def timings(run) -> tuple[float, float]:
    eager = triton.testing.do_bench(run, return_mode="median")
    return eager, triton.testing.do_bench_cudagraph(run, return_mode="median")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--num-kv-splits", type=int, default=DEFAULT_KV_SPLITS)
    return p.parse_args(argv)


def warm_up_clocks() -> None:
    """A moment of matrix products first: an idle GPU's low clocks would slow the first rows."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        x @ x
    torch.cuda.synchronize()


def make_pool(num_reqs: int, seq_len: int, args: argparse.Namespace, dtype: torch.dtype):
    """k_buf, v_buf and req_to_token rows 0..num_reqs-1, each holding seq_len shuffled slots."""
    total = num_reqs * seq_len
    shape = (total + 1, args.kv_heads, args.head_dim)
    k_buf = torch.randn(shape, device="cuda", dtype=dtype)
    v_buf = torch.randn(shape, device="cuda", dtype=dtype)
    table = (torch.randperm(total, device="cuda") + 1).view(num_reqs, seq_len)
    return k_buf, v_buf, table


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def decode_inputs(batch: int, seq_len: int, args: argparse.Namespace, dtype: torch.dtype) -> tuple:
    """(q, k_buf, v_buf, out, table, rows, lens, scratch, scale): decode_attention's arguments."""
    k_buf, v_buf, table = make_pool(batch, seq_len, args, dtype)
    q = torch.randn(batch, args.heads, args.head_dim, device="cuda", dtype=dtype)
    rows = torch.arange(batch, device="cuda")
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    scratch = decode_scratch(batch, args.heads, args.head_dim, args.num_kv_splits, "cuda")
    return q, k_buf, v_buf, torch.empty_like(q), table, rows, lens, scratch, args.head_dim**-0.5


def bench_decode(batch: int, seq_len: int, args: argparse.Namespace, dtype: torch.dtype) -> Row:
    inputs = decode_inputs(batch, seq_len, args, dtype)
    q, k_buf, v_buf, out, table, _, _, _, scale = inputs
    run = lambda: decode_attention(*inputs)
    run()
    k = k_buf[table].float().transpose(1, 2)  # [B, Hkv, S, D]
    v = v_buf[table].float().transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]
    err = rel_err(out, ref)
    del k, v, ref
    kv_bytes = 2 * batch * seq_len * args.kv_heads * args.head_dim * q.element_size()
    return Row(f"decode B={batch} seq={seq_len}", err, *timings(run), kv_bytes)


def bench_cascade(groups: int, members: int, prefix: int, own: int, args: argparse.Namespace,
                  dtype: torch.dtype) -> tuple[Row, Row]:  # fmt: skip
    """`groups` x `members` decodes, each over a shared `prefix` plus `own` tokens of its own: the plain
    decode kernel (every request reads the prefix) against the cascade path (once per tile)."""
    batch, seq_len = groups * members, prefix + own
    inputs = decode_inputs(batch, seq_len, args, dtype)
    q, out, table = inputs[0], inputs[3], inputs[4]
    for g in range(groups):
        first = g * members
        table[first + 1 : first + members, :prefix] = table[first, :prefix]
    br = block_r(torch.device("cuda"), args.heads // args.kv_heads)
    firsts = [g * members + a for g in range(groups) for a in range(0, members, br)]
    counts = [min(br, members - a) for _ in range(groups) for a in range(0, members, br)]
    t = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    plan = CascadePlan(t([prefix] * batch), t(list(range(batch))), t(firsts), t(counts),
                       t([prefix] * len(firsts)), t(firsts), len(firsts), br)  # fmt: skip
    plain = lambda: decode_attention(*inputs)
    plain()
    ref = out.float().clone()
    cascade = lambda: decode_attention(*inputs, plan)
    cascade()
    err = rel_err(out, ref)
    kv_bytes = 2 * batch * seq_len * args.kv_heads * args.head_dim * q.element_size()
    shape = f"{groups}x{members} over {prefix}+{own}"
    return Row(f"decode {shape}", 0.0, *timings(plain), kv_bytes), Row(
        f"cascade {shape}", err, *timings(cascade), kv_bytes
    )


def bench_extend(num_reqs: int, ext: int, prefix: int, args: argparse.Namespace, dtype: torch.dtype) -> Row:
    k_buf, v_buf, table = make_pool(num_reqs, prefix + ext, args, dtype)
    q = torch.randn(num_reqs * ext, args.heads, args.head_dim, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    rows = torch.arange(num_reqs, device="cuda")
    prefix_lens = torch.full((num_reqs,), prefix, device="cuda")
    ext_lens = torch.full((num_reqs,), ext, device="cuda")
    starts = torch.arange(num_reqs, device="cuda") * ext
    scale = args.head_dim**-0.5
    run = lambda: extend_attention(
        q, out, k_buf, v_buf, table, rows, prefix_lens, ext_lens, starts, ext, scale
    )
    run()
    k = k_buf[table].float().transpose(1, 2)  # [R, Hkv, S, D]
    v = v_buf[table].float().transpose(1, 2)
    qr = q.float().view(num_reqs, ext, args.heads, args.head_dim).transpose(1, 2)
    pos = torch.arange(prefix, prefix + ext, device="cuda")
    mask = torch.arange(prefix + ext, device="cuda") <= pos[:, None]
    ref = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    err = rel_err(out, ref.transpose(1, 2).reshape(out.shape))
    del k, v, ref
    visible = num_reqs * (ext * prefix + ext * (ext + 1) // 2)  # (query, key) pairs
    kv_bytes = 2 * num_reqs * (prefix + ext) * args.kv_heads * args.head_dim * q.element_size()
    flops = 4 * visible * args.heads * args.head_dim
    return Row(f"extend {num_reqs}x{ext} prefix={prefix}", err, *timings(run), kv_bytes, flops)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernel_bench needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    print(
        f"{name}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {args.dtype}, "
        f"{args.num_kv_splits} kv splits"
    )
    warm_up_clocks()
    rows = [bench_decode(b, s, args, dtype) for b, s in DECODE_SHAPES]
    rows += [bench_extend(n, e, p, args, dtype) for n, e, p in EXTEND_SHAPES]
    rows += [row for shape in CASCADE_SHAPES for row in bench_cascade(*shape, args, dtype)]
    print(HEADER)
    for r in rows:
        print(r.line())
    bad = [r.shape for r in rows if not r.err < 2e-2]
    if bad:
        raise SystemExit(f"wrong results: {', '.join(bad)}")


if __name__ == "__main__":
    main()
