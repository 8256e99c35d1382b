"""The HF transformers peer on a GPU: `generate_batch` (continuous batching, paged `paged|sdpa`) on
random weights of a config-only model folder, the same kind of workload as `benchmarks.offline
--load-format dummy --random-range-ratio 1.0` (fixed lengths: one GenerationConfig covers every
prompt, so per-request output lengths cannot vary). EOS is disabled so every request generates
exactly --output-len tokens.

    python -m benchmarks.hf_generate_batch --model-path .gpu/llama3-8b --num-prompts 500 \\
        --input-len 256 --output-len 512
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="folder with a config.json (weights are random)")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--attn-implementation", default="paged|sdpa")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation import GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(args.model_path)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, args.dtype), attn_implementation=args.attn_implementation
        )
    model.eval()
    gen = torch.Generator().manual_seed(args.seed)
    vocab = config.vocab_size
    shape = (args.num_prompts, args.input_len)
    prompts = torch.randint(0, vocab, shape, generator=gen).tolist()
    cfg = GenerationConfig(
        max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    model.generate_batch(inputs=prompts[:2], generation_config=cfg)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=cfg)
    if device == "cuda":
        torch.cuda.synchronize()
    duration = time.perf_counter() - t0
    generated = sum(len(o.generated_tokens) for o in outs.values())
    result = {
        "backend": f"hf-transformers generate_batch ({args.attn_implementation})",
        "requests": len(outs),
        "duration_s": round(duration, 2),
        "output_tokens": generated,
        "output_tok_s": round(generated / duration, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
