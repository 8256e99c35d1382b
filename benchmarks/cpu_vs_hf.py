"""sglbus against HF transformers' batched `generate` on CPU, one equal-length random batch, in rounds
that alternate the two in one process (so a noisy machine slows both alike): the engine/HF speed
ratio per round and its median. Greedy, `ignore_eos` / `min_new_tokens`, so both do the same work.

    python -m benchmarks.cpu_vs_hf --batch 32 --input-len 128 --output-len 64 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model-path", default=None, help="default: the default model")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    import sglbus

    engine = sglbus.Engine(model_path=args.model_path, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(engine.model_folder, dtype=torch.float32).eval()
    rng = random.Random(0)
    ids = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.batch)]
    n = args.output_len

    def run_engine(tokens: int) -> float:
        engine.flush_cache()
        t = time.perf_counter()
        engine.generate(
            input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
        )
        return time.perf_counter() - t

    def run_hf(tokens: int) -> float:
        x = torch.tensor(ids)
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens,
                        do_sample=False, pad_token_id=0)  # fmt: skip
        return time.perf_counter() - t

    run_engine(2), run_hf(2)  # warm-up
    ratios = []
    for i in range(args.rounds):
        te, th = run_engine(n), run_hf(n)
        ratios.append(th / te)
        print(f"round {i}: sglbus {te:.2f} s, HF {th:.2f} s, sglbus speed / HF {th / te:.3f}", flush=True)
    print(f"median sglbus speed / HF over {args.rounds} rounds: {statistics.median(ratios):.3f}")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
