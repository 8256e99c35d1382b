"""Large batches on a busy machine: are any requests wrongly failed ("lost on the bus" 503s)?

Each round sends, at once, a batch of `--batch` short prompts with max_new_tokens 1 and `--long` prompts
of 1.6k-6.4k tokens with max_new_tokens 1 (every other one with prompt logprobs), and counts the answers
that are not 200 or that miss a prompt. Run it while the machine is loaded (for example beside the
test suite) to check the "0 false 503s in 20 large batches" target.

    sglbus bench large-batches --launch-server --rounds 20
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import httpx

from benchmarks.launch import add_target_args, append_result, machine_info, target


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_target_args(p)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batch", type=int, default=2000, help="short prompts per batch request")
    p.add_argument("--long", type=int, default=2, help="long single-token prompts per round")
    p.add_argument("--output-file", default=None, help="append one JSONL row")
    return p.parse_args(argv)


async def one_round(http: httpx.AsyncClient, args: argparse.Namespace, r: int) -> list[str]:
    """The problems of one round (empty: every request got its 200)."""
    greedy = {"temperature": 0, "max_new_tokens": 1}
    jobs = [http.post("/generate", json={"text": [f"Round {r} item {i}: hi" for i in range(args.batch)],
                                         "sampling_params": greedy})]  # fmt: skip
    for i in range(args.long):
        words = (250, 1000)[i % 2]  # ~1.6k and ~6.3k tokens with the default tokenizer
        body: dict[str, Any] = {
            "text": " ".join(f"r{r}w{j}" for j in range(words)),
            "sampling_params": greedy,
        }
        if i % 2:
            body |= {"return_logprob": True, "logprob_start_len": 0}
        jobs.append(http.post("/generate", json=body))
    problems = []
    for i, resp in enumerate(await asyncio.gather(*jobs, return_exceptions=True)):
        if isinstance(resp, Exception):
            problems.append(f"request {i}: {type(resp).__name__}: {resp}")
        elif resp.status_code != 200:
            problems.append(f"request {i}: {resp.status_code} {resp.text[:200]}")
        elif i == 0 and len(resp.json()) != args.batch:
            problems.append(f"batch answered {len(resp.json())} of {args.batch}")
    return problems


async def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    problems: list[str] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=1800) as http:
        for r in range(args.rounds):
            found = await one_round(http, args, r)
            print(f"round {r + 1}/{args.rounds}: {'ok' if not found else found}", flush=True)
            problems += found
    return {"rounds": args.rounds, "failed_requests": len(problems), "problems": problems[:10],
            "duration_s": time.perf_counter() - t0}  # fmt: skip


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    machine = machine_info()
    with target(args) as server:
        result = asyncio.run(run(args, server.base))
    print(f"{result['rounds']} rounds, {result['failed_requests']} failed requests, "
          f"{result['duration_s']:.0f} s; load at start {machine['loadavg_1m_at_start']:.1f}")  # fmt: skip
    if args.output_file:
        append_result(args.output_file, vars(args), machine, result)
    return 0 if not result["failed_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
