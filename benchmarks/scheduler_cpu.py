"""Host time of one scheduler step by batch size, with a model that costs nothing (CPU).

Everything a step does on the host besides the forward itself: planning, slot allocation, the
ForwardBatch, logits processors, the draw of greedy tokens, per-request bookkeeping and the step's
output rows. On a GPU with overlap scheduling this time hides behind the device's, as long as it
stays below the forward's; it grows linearly with the batch.

    python -m benchmarks.scheduler_cpu --batch-sizes 256 1024 2048
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

    def __init__(self, batch: int, context: int) -> None:
        self.device, self.context_len = torch.device("cpu"), context
        self.max_running_requests, self.chunked_prefill_size, self.overlap_schedule = batch, 8192, False
        self.model_config = SimpleNamespace(eos_token_ids=(VOCAB - 1,), vocab_size=VOCAB)
        shape = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
        self.kv = KVPool(shape, batch * context, torch.float32, "cpu")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    print(f"{'batch':>6} {'ms per step':>12} {'us per request':>15}")
    for b in args.batch_sizes:
        ms = step_ms(b, args.steps)
        print(f"{b:>6} {ms:>12.2f} {1e3 * ms / b:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
