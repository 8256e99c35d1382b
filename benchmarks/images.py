"""Image requests against a LLaVA-style sglbus server: each request one (or more) random pictures of
its own (PNG, base64; distinct, so the prefix cache never serves an image) before a random prompt of
`--input-len` token ids, `--output-len` tokens out, at most `--max-concurrency` at once. Prints image
requests per second, output tokens per second, TTFT and inter-token latency (streamed).

    python -m benchmarks.images --launch-server --server-args "--model-path <llava folder> \\
        --load-format dummy" --num-prompts 512 --max-concurrency 64

The image token id is read from the model folder's config.json (`--model-folder`, default: the
`--model-path` in --server-args)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shlex
import sys
import time

import numpy as np

from benchmarks.launch import add_target_args, append_result, machine_info, percentile, target
from benchmarks.serving import Output, _session, send


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_target_args(p)
    p.add_argument("--model-folder", default=None, help="for the image token id (default: --model-path)")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64, help="text token ids after the images")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--image-count", type=int, default=1, help="images per request")
    p.add_argument("--image-size", default="560x448", help="WxH of each picture before the processor")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSONL row with all metrics")
    return p.parse_args(argv)


def image_token(args: argparse.Namespace) -> tuple[int, int]:
    """(image token id, text vocabulary size) from the model's config.json."""
    folder = args.model_folder
    if folder is None:
        words = shlex.split(args.server_args)
        folder = words[words.index("--model-path") + 1] if "--model-path" in words else None
    if folder is None:
        raise SystemExit(
            "give --model-folder (or --model-path in --server-args): the image token is in its config"
        )
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    token = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
    return token, (cfg.get("text_config") or {}).get("vocab_size", 32000)


def pictures(n: int, size: str, seed: int) -> list[str]:
    from PIL import Image

    w, h = (int(x) for x in size.split("x"))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


async def run(args: argparse.Namespace, base: str) -> tuple[list[Output], float]:
    token, vocab = image_token(args)
    rng = np.random.default_rng(args.seed)
    k = args.image_count
    images = pictures(args.num_prompts * k + 2 * k, args.image_size, args.seed)
    prompts = [[token] * k + rng.integers(100, min(vocab, token) - 1, args.input_len).tolist()
               for _ in range(args.num_prompts + 2)]  # fmt: skip
    sem = asyncio.Semaphore(args.max_concurrency)
    async with _session() as client:

        async def one(i: int) -> Output:
            async with sem:
                top = {"image_data": images[i * k : (i + 1) * k]}
                return await send(client, base + "/generate", prompts[i], args.output_len, top, {})

        warm = await asyncio.gather(one(args.num_prompts), one(args.num_prompts + 1))
        if not all(o.success for o in warm):
            raise SystemExit(f"warm-up failed: {[o.error for o in warm]}")
        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(i) for i in range(args.num_prompts)))
        return list(outputs), time.perf_counter() - start


def report(args: argparse.Namespace, outputs: list[Output], duration: float) -> dict:
    ok = [o for o in outputs if o.success]
    ttft = [o.ttft * 1000 for o in ok]
    itl = [x * 1000 for o in ok for x in o.itl]
    m = {
        "completed": len(ok), "failed": len(outputs) - len(ok), "duration_s": duration,
        "image_requests_per_s": len(ok) / duration, "images_per_s": len(ok) * args.image_count / duration,
        "output_throughput": sum(o.output_len for o in ok) / duration,
        "median_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
        "median_itl_ms": percentile(itl, 50), "p99_itl_ms": percentile(itl, 99),
    }  # fmt: skip
    for key, value in m.items():
        print(f"{key:<24} {value:.2f}" if isinstance(value, float) else f"{key:<24} {value}")
    errors = {o.error for o in outputs if not o.success}
    if errors:
        print("errors:", list(errors)[:3])
    return m


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with target(args) as server:
        outputs, duration = asyncio.run(run(args, server.base))
    m = report(args, outputs, duration)
    if args.output_file:
        append_result(args.output_file, vars(args), machine_info(), {"metrics": m})
    return 0 if m["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
