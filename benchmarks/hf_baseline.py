"""The HF transformers baseline: the same weights (fp32) and workload through batched `generate`.

Equal work: every prompt gets exactly its input tokens and at least its requested output tokens
(`min_new_tokens` keeps EOS from stopping a row early, like `ignore_eos` in the engine). Prompts are
sorted by (output length, input length) before batching, which is the best static batching can do:
little left padding, and batch members that want about as many tokens. A batch still decodes to its
longest request; those extra tokens (`wasted_tokens`) cost HF time but are not counted as output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from benchmarks.workloads import Workload


@dataclass
class HFResult:
    duration_s: float
    input_tokens: int
    output_tokens: int  # requested tokens only
    wasted_tokens: int  # decoded past a row's request because its batch wanted more
    batches: int


def run_hf(
    model_folder: str, workload: Workload, batch_size: int, pad_id: int, device: torch.device
) -> HFResult:
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).to(device).eval()
    order = sorted(range(len(workload)), key=lambda i: (workload[i][1], len(workload[i][0])))
    batches = [[workload[i] for i in order[k : k + batch_size]] for k in range(0, len(order), batch_size)]
    # warmup outside the timer: first-call allocations and lazy inits are not part of throughput
    _generate(model, [(workload[0][0][:8], 2)], pad_id)
    wasted = 0
    t0 = time.perf_counter()
    for batch in batches:
        wasted += _generate(model, batch, pad_id)
    duration = time.perf_counter() - t0
    return HFResult(
        duration_s=duration,
        input_tokens=sum(len(ids) for ids, _ in workload),
        output_tokens=sum(n for _, n in workload),
        wasted_tokens=wasted,
        batches=len(batches),
    )


@torch.inference_mode()
def _generate(model: PreTrainedModel, batch: Workload, pad_id: int) -> int:
    """Greedy-decode one left-padded batch to its longest output; returns the wasted token count."""
    width = max(len(ids) for ids, _ in batch)
    new = max(n for _, n in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=pad_id,
    )
    if out.shape[1] != width + new:
        raise RuntimeError("HF stopped early: the work would not be equal")
    return sum(new - n for _, n in batch)
