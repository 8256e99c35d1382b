"""What the router adds per request: `Router.route` (hash the prompt's blocks, look them up in the
index of every worker's cache, score the workers) and its release, timed one by one on a populated
index, as a gateway runs them.

    python -m benchmarks.route_latency --workers 4 --groups 32 --system-len 1024 --question-len 128

The index holds every group's system prompt on one worker (what the workers' KvEvents would have
built); requests cycle through the groups with new questions. Prints p50 / p99 / mean per request.

`--simulate-burst`: instead, route a burst (questions-per-group prompts of each group, shuffled
together, nothing computed or reported yet: only the router's own counts decide) and print how many
groups went to more than one worker and the requests per worker."""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import numpy as np

from services.gateway.router.router import Router
from shared.kv_blocks import block_hashes
from shared.messages import KvEvents, WorkerLoad, encode
from shared.transport import InProcessTransport, Message, Subjects


async def run(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    workers = [str(i) for i in range(args.workers)]
    router = Router(args.policy, InProcessTransport(), Subjects(), lambda: workers)
    systems = [[rng.randrange(49152) for _ in range(args.system_len)] for _ in range(args.groups)]
    for g, system in enumerate(systems):  # each group's prefix cached on one worker
        w = workers[g % len(workers)]
        ev = KvEvents(worker=w, instance="x", seq=g // len(workers) + 1, stored=block_hashes(system),
                      load=WorkerLoad(running=8, waiting=2, waiting_tokens=512))  # fmt: skip
        await router._on_events(Message(f"sglbus.kv.{w}", encode(ev)))
    prompts = [systems[i % args.groups] + [rng.randrange(49152) for _ in range(args.question_len)]
               for i in range(args.requests)]  # fmt: skip
    times = np.empty(len(prompts))
    for i, p in enumerate(prompts):
        t = time.perf_counter()
        route = router.route(p)
        router.release(route, grace=0)
        times[i] = time.perf_counter() - t
    return {"p50_us": float(np.median(times) * 1e6), "p99_us": float(np.percentile(times, 99) * 1e6),
            "mean_us": float(times.mean() * 1e6), "hits": router.decisions["hit"]}  # fmt: skip


async def burst(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    workers = [str(i) for i in range(args.workers)]
    router = Router(args.policy, InProcessTransport(), Subjects(), lambda: workers)
    systems = [[rng.randrange(49152) for _ in range(args.system_len)] for _ in range(args.groups)]
    reqs = [(g, systems[g] + [rng.randrange(49152) for _ in range(args.question_len)])
            for g in range(args.groups) for _ in range(args.questions_per_group)]  # fmt: skip
    rng.shuffle(reqs)
    where: dict[int, set[str]] = {}
    per = dict.fromkeys(workers, 0)
    for g, prompt in reqs:
        w = router.route(prompt).worker
        where.setdefault(g, set()).add(w)
        per[w] += 1
    split = sum(len(ws) > 1 for ws in where.values())
    print(f"{len(reqs)} requests of {args.groups} groups on {args.workers} workers ({args.policy}): "
          f"{split} groups on several workers; requests per worker {list(per.values())}; "
          f"decisions {dict(router.decisions)}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.route_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate-burst", action="store_true", help="see above")
    p.add_argument("--questions-per-group", type=int, default=16, help="--simulate-burst")
    args = p.parse_args(argv)
    if args.simulate_burst:
        asyncio.run(burst(args))
        return
    out = asyncio.run(run(args))
    tokens = args.system_len + args.question_len
    print(f"route + release per request ({args.workers} workers, {args.groups} groups, prompts of {tokens} "
          f"tokens): p50 {out['p50_us']:.0f} us, p99 {out['p99_us']:.0f} us, mean {out['mean_us']:.0f} us; "
          f"{out['hits']} hits of {args.requests}")  # fmt: skip


if __name__ == "__main__":
    main()
