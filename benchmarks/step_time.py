"""Decode step time by batch size, and where it goes, against the floors (GPU).

For each batch size B every request has `--context` tokens of KV (random slots of the pool); one
decode step is timed as the engine runs it (CUDA graph where B fits one, else eager), and its parts
alone: attention over all layers, the linear layers alone (captured in a CUDA graph: the floor the
linears allow), greedy sampling with the copy of the ids to the host. The KV floor is the bytes of KV
the step must read at the measured copy bandwidth.

    python -m benchmarks.step_time --model-path <config folder> --load-format dummy \
        --batch-sizes 1 64 256 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from services.scheduler.forward_batch import ForwardBatch
from services.scheduler.model_runner import ModelRunner
from shared.config import EngineConfig, add_cli_args, cli_overrides

COPY_BW = 4.25e12  # bytes/s, device copy measured on the lent H200 (NOTES.md)


def cuda_time(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() measured with CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph; returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def decode_batch(runner: ModelRunner, b: int, context: int) -> ForwardBatch:
    slots = runner.kv.alloc(b * context)
    assert slots is not None, "pool too small for this batch and context"
    rows = list(range(b))
    runner.req_to_token.table[:b, :context] = slots[torch.randperm(slots.numel(), device=slots.device)].view(
        b, context
    )
    vocab = runner.model_config.vocab_size
    ids = torch.randint(0, vocab, (b,)).tolist()
    loc = runner.req_to_token.table[:b, context - 1].clone()
    return ForwardBatch.build(ids, rows, [context - 1] * b, [1] * b, loc, None, [], runner.device)


def linear_floor(runner: ModelRunner, b: int) -> float:
    model = runner.model
    x = torch.randn(b, runner.model_config.hidden_size, dtype=runner.dtype, device=runner.device)

    def linears() -> None:
        for layer in model.layers:  # dense layers (the Llama shapes this tool times)
            attn, mlp = layer.attn, layer.mlp
            qkv = F.linear(x, attn.qkv_proj)
            o = F.linear(qkv[:, : attn.q_size], attn.o_proj)
            gu = F.linear(o, mlp.gate_up_proj)
            F.linear(gu[:, : gu.shape[1] // 2], mlp.down_proj)
        F.linear(x, model.lm_head)

    return cuda_time(graphed(linears))


def attention_time(runner: ModelRunner, fb: ForwardBatch) -> float:
    mc = runner.model_config
    b = fb.batch_size
    q = torch.randn(b, mc.num_heads, mc.head_dim, dtype=runner.dtype, device=runner.device)
    k = torch.randn(b, mc.num_kv_heads, mc.head_dim, dtype=runner.dtype, device=runner.device)
    v = torch.randn_like(k)
    runner.attn.prepare(fb)

    def attn() -> None:
        for layer in range(mc.num_layers):
            runner.attn.forward(q, k, v, layer, fb)

    return cuda_time(attn)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags = ("model_path", "load_format", "dtype", "attention_backend", "cuda_graph_max_bs",
             "disable_cuda_graph", "max_total_tokens")  # fmt: skip
    add_cli_args(p, EngineConfig, only=flags)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 1024])
    p.add_argument("--context", type=int, default=512, help="KV tokens per request")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("step_time needs a CUDA GPU (it times the steps with CUDA events)")
    cfg = EngineConfig.from_env(
        **cli_overrides(args, EngineConfig), max_running_requests=max(args.batch_sizes)
    )
    from shared.model_files import resolve_model_folder

    runner = ModelRunner(cfg, resolve_model_folder(cfg.model_path, cfg.load_format != "dummy"))
    mc = runner.model_config
    kv_bytes = mc.kv_bytes_per_token * torch.finfo(runner.dtype).bits // 8
    print(f"{'batch':>6} {'step ms':>8} {'eager ms':>9} {'attn ms':>8} {'linear ms':>10} {'sample ms':>10} "
          f"{'floor ms':>9} {'step/floor':>10}")  # fmt: skip
    for b in args.batch_sizes:
        fb = decode_batch(runner, b, args.context)
        step = cuda_time(lambda fb=fb: runner.forward(fb))
        graphs, runner.graphs = runner.graphs, None
        eager = cuda_time(lambda fb=fb: runner.forward(fb))
        runner.graphs = graphs
        attn = attention_time(runner, fb)
        lin = linear_floor(runner, b)
        logits = runner.forward(fb).logits

        def sample(logits=logits) -> None:
            logits.argmax(dim=-1).tolist()

        samp = cuda_time(sample)
        floor = lin + 1e3 * b * args.context * kv_bytes / COPY_BW
        print(f"{b:>6} {step:>8.2f} {eager:>9.2f} {attn:>8.2f} {lin:>10.2f} {samp:>10.2f} {floor:>9.2f} "
              f"{step / floor:>10.2f}")  # fmt: skip
        runner.kv.free(runner.req_to_token.table[:b, : args.context].reshape(-1).clone())
    return 0


if __name__ == "__main__":
    sys.exit(main())
