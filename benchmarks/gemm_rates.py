"""The linear layers of a Llama-3-8B shape and the LM head's greedy draw, alone on the GPU.

Each product F.linear(x [M, K], W [N, K]) is captured in a CUDA graph and replayed (the way decode
runs them), in passes that alternate the BLAS library torch prefers (cuBLAS, cuBLASLt): the rates
move with the chip's clocks under sustained load, which alternating passes show. Then the LM head
plus the greedy draw three ways: the bf16 product copied into a float32 buffer (before 2026-12-03),
the product written as float32 by the GEMM (`out_dtype`), and the bf16 logits argmaxed directly
(what the engine does now); "agree" is the share of rows whose id equals the first way's.

    python -m benchmarks.gemm_rates --rows 1024 2048 2400 10240
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.step_time import cuda_time, graphed
from sglbus_kernels.greedy_argmax import greedy_argmax

HIDDEN, INTER, VOCAB, Q, KV = 4096, 14336, 128256, 4096, 1024
# name -> (N, K) of the weight
SHAPES = {
    "qkv": (Q + 2 * KV, HIDDEN),
    "o": (HIDDEN, Q),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
CAP = 1e30  # the sampler's logit cap


def linear_rates(rows: list[int], libraries: list[str]) -> None:
    weights = {
        k: torch.randn(n, k_, device="cuda", dtype=torch.bfloat16) * 0.02 for k, (n, k_) in SHAPES.items()
    }
    for lib in libraries:
        torch.backends.cuda.preferred_blas_library(lib)
        for m in rows:
            cells, layer_ms = [], 0.0
            for name, (n, k) in SHAPES.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ms = cuda_time(graphed(lambda x=x, w=weights[name]: F.linear(x, w)))
                cells.append(f"{name} {ms:.3f} ms {2 * m * n * k / ms / 1e9:.0f} TF/s")
                layer_ms += ms if name != "lm_head" else 0.0
            print(f"{lib:9s} M={m:6d}  32 layers {32 * layer_ms:7.2f} ms | " + " | ".join(cells), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


def _draw_ways(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> dict:
    """The LM head + greedy draw of hidden states h three ways (out: a float32 [M, vocab] buffer)."""
    return {
        "bf16 + float32 copy + argmax": lambda: greedy_argmax(out.copy_(F.linear(h, w)), CAP),
        "float32 GEMM (out_dtype) + argmax": lambda: greedy_argmax(
            torch.mm(h, w.t(), out_dtype=torch.float32, out=out), CAP
        ),
        "bf16 argmax": lambda: greedy_argmax(F.linear(h, w), CAP),
    }


def lm_head_draw(rows: list[int]) -> None:
    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    buf = torch.empty(max(rows), VOCAB, device="cuda", dtype=torch.float32)
    for m in rows:
        ways = _draw_ways(torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16), w, buf[:m])
        ids = [f() for f in ways.values()]
        cells = [
            f"{name} {cuda_time(graphed(f)):.3f} ms (agree {(ids[0] == i).float().mean().item():.3f})"
            for (name, f), i in zip(ways.items(), ids, strict=True)
        ]
        print(f"LM head + greedy, M={m:6d} | " + " | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 2048, 2400, 10240])
    p.add_argument("--passes", type=int, default=2, help="alternating cuBLAS / cuBLASLt pairs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gemm_rates needs a CUDA GPU")
    torch.manual_seed(0)
    linear_rates(args.rows, ["cublas", "cublaslt"] * args.passes)
    lm_head_draw([m for m in args.rows if m <= 4096])


if __name__ == "__main__":
    main()
