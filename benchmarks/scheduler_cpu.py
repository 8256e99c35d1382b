"""Host time of one scheduler step by batch size, with a model that costs nothing (CPU).

Everything a step does on the host besides the forward itself: planning, slot allocation, the
ForwardBatch, logits processors, the draw of greedy tokens, per-request bookkeeping and the step's
output rows. On a GPU with overlap scheduling this time hides behind the device's, as long as it
stays below the forward's; it grows linearly with the batch.

    python -m benchmarks.scheduler_cpu --batch-sizes 256 1024 2048
    python -m benchmarks.scheduler_cpu --seed-workload 3000    # the seed's lengths, start to end

`--seed-workload N` runs N requests with the seed workload's lengths (input 1-256, output 1-512
tokens, all submitted at once, overlap scheduling on) through admission, chunked prefill, decode and
finishing, and prints the host time of each step phase by step kind and batch size
(StepTimer.laps): the same table `benchmarks.offline --step-trace` prints on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import torch

from services.scheduler.forward_batch import LogitsOutput
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.sampling.sampler import sample
from services.scheduler.scheduler import Scheduler
from shared.config import EngineConfig
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams

VOCAB = 64


class NoModel:
    """A runner whose forward returns logits at once: the next token is the last one + 1."""

    def __init__(self, batch: int, context: int, kv_tokens: int | None = None, overlap: bool = False) -> None:
        self.device, self.context_len = torch.device("cpu"), context
        self.max_running_requests, self.chunked_prefill_size, self.overlap_schedule = batch, 8192, overlap
        self.rows_max_tokens = 0
        self.model_config = SimpleNamespace(eos_token_ids=(VOCAB - 1,), vocab_size=VOCAB)
        shape = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
        self.kv = KVPool(shape, kv_tokens or batch * context, torch.float32, "cpu")
        self.req_to_token = ReqToTokenPool(batch + 8, context + 1, "cpu")
        self.model = SimpleNamespace(logits=lambda hidden: hidden)

    def forward(self, fb) -> LogitsOutput:
        last = fb.input_ids if fb.logits_idx is None else fb.input_ids[fb.logits_idx]
        return LogitsOutput(torch.nn.functional.one_hot((last + 1) % (VOCAB - 1), VOCAB).float(), None)

    def sample(self, logits, info, output_lens, check=True):
        return sample(logits, info, output_lens, check)


def step_ms(batch: int, steps: int) -> float:
    sched = Scheduler(EngineConfig(max_running_requests=batch), NoModel(batch, 1024))
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        sched.add_request(
            GenerateReq(rid=f"r{i}", input_ids=[1 + i % 50, 2, 3, 4], sampling=params, out_subject="x")
        )
    for _ in range(5):  # admission and the first decodes
        sched.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    return (time.perf_counter() - t0) / steps * 1e3


def seed_workload(n: int, kv_tokens: int) -> tuple[float, int, str]:
    """Seconds, steps and the laps table of n seed-workload requests from submission to the end."""
    import random

    from benchmarks.step_trace import summarize_laps

    rng = random.Random(0)
    sched = Scheduler(EngineConfig(max_running_requests=4096), NoModel(4096, 1024, kv_tokens, overlap=True))
    for i in range(n):
        params = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 512), ignore_eos=True)
        ids = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(1, 256))]
        sched.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, sampling=params, out_subject="x"))
    sched.timer.laps = []
    t0 = time.perf_counter()
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
    return time.perf_counter() - t0, steps, summarize_laps(sched.timer.laps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--steps", type=int, default=30)
    seed_help = "N requests of the seed workload's lengths"
    p.add_argument("--seed-workload", type=int, default=0, metavar="N", help=seed_help)
    p.add_argument("--kv-tokens", type=int, default=850_000, help="KV pool of the seed workload run")
    args = p.parse_args(argv)
    if args.seed_workload:
        seconds, steps, table = seed_workload(args.seed_workload, args.kv_tokens)
        print(table)
        print(f"{args.seed_workload} requests, {steps} steps, {seconds:.2f} s of host time")
        return 0
    print(f"{'batch':>6} {'ms per step':>12} {'us per request':>15}")
    for b in args.batch_sizes:
        ms = step_ms(b, args.steps)
        print(f"{b:>6} {ms:>12.2f} {1e3 * ms / b:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
