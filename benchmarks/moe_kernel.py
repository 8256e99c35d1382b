"""fused_moe (sglbus_kernels/fused_moe.py) against the per-expert torch loop it replaces (moe_reference:
for each expert, gather its tokens, gate_up matmul, silu * up, down matmul, weighted index_add), on the
GPU at the MoE layer shapes of Qwen3-30B-A3B and Mixtral-8x7B: median us per call from
triton.testing.do_bench, and the fused path replayed from a CUDA graph (how decode runs it; the torch
loop reads expert counts on the host, so it cannot be captured).

    python -m benchmarks.moe_kernel                      # both shapes, T = 1 .. 4096
    python -m benchmarks.moe_kernel --sweep --tokens 1 256   # time other tiles, print the best
"""

from __future__ import annotations

import argparse
import sys

import torch

# name: (experts, top_k, hidden, intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (1, 16, 64, 256, 1024, 4096)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sweep_configs():
    """The tiles --sweep tries: the BLOCK_M ladder against a few column and depth tiles."""
    from sglbus_kernels.fused_moe import MoEConfig

    out = []
    for block_m in (16, 32, 64, 128):
        for block_n, block_k in ((64, 128), (128, 64), (128, 128), (256, 64)):
            for num_warps in (4, 8):
                group_m = 1 if block_m == 16 else 8
                out.append(
                    MoEConfig(block_m, block_n, block_k, group_m, num_warps, 3 if block_n == 256 else 4)
                )
    return out


def case(shape, tokens: int, dtype: torch.dtype, weights):
    """x and a softmax top-k routing of random router logits, renormalised as both models do."""
    num_experts, top_k, hidden, _ = shape
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    probs = torch.randn(tokens, num_experts, device="cuda").softmax(-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    return (x, *weights, topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids.to(torch.int32))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="T values")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph column")
    parser.add_argument("--sweep", action="store_true", help="also time the tiles of sweep_configs()")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("moe_kernel times the GPU kernels and needs CUDA")
    from triton.testing import do_bench, do_bench_cudagraph

    from sglbus_kernels.fused_moe import fused_moe, moe_config, moe_reference

    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, median us per call (triton.testing.do_bench)")
    head = f"{'shape':<15}{'T':>6}{'torch':>11}{'fused':>11}{'ratio':>8}{'graph':>11}{'err':>9}"
    print(head + "  tiles (M, N, K, group, warps, stages)")
    for name in args.shapes:
        shape = SHAPES[name]
        num_experts, top_k, hidden, inter = shape
        w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, device="cuda") / hidden**0.5).to(dtype)
        w_down = (torch.randn(num_experts, hidden, inter, device="cuda") / inter**0.5).to(dtype)
        for t in args.tokens:
            inputs = case(shape, t, dtype, (w_gate_up, w_down))
            ref = moe_reference(*inputs)
            out = fused_moe(*inputs)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

            def ref_call(inputs=inputs):
                return moe_reference(*inputs)

            def fused_call(inputs=inputs, config=None):
                return fused_moe(*inputs, config=config)

            us_ref = 1e3 * do_bench(ref_call, return_mode="median")
            us_fused = 1e3 * do_bench(fused_call, return_mode="median")
            us_graph = float("nan")
            if not args.no_graph:
                us_graph = 1e3 * do_bench_cudagraph(fused_call, return_mode="median")
            cfg = moe_config(t, top_k, num_experts, w_gate_up.device)
            tiles = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages)
            print(
                f"{name:<15}{t:>6}{us_ref:>11.1f}{us_fused:>11.1f}{us_ref / us_fused:>7.2f}x"
                f"{us_graph:>11.1f}{err:>9.1e}  {tiles}"
            )
            if args.sweep:
                timed = []
                for c in sweep_configs():
                    try:
                        us = do_bench(lambda c=c: fused_call(config=c), return_mode="median")
                        timed.append((1e3 * us, c))
                    except Exception as exc:  # tiles past the shared memory: skip them
                        print(f"{'':<21}skip {c}: {type(exc).__name__}")
                for us, c in sorted(timed, key=lambda pair: pair[0])[:3]:
                    print(f"{'':<21}sweep {us:>9.1f} us  {c}")
            del inputs, ref, out
        del w_gate_up, w_down
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
