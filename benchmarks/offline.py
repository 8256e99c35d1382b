"""Offline throughput benchmark (SGLang's bench_offline_throughput): the whole workload is submitted to
`sglbus.Engine.generate` at once and continuously batched; optionally the same workload runs through
HF transformers (`--compare-hf`) and/or the engine without its radix cache (`--compare-no-cache`).

    python -m benchmarks.offline --dataset-name shared-prefix --compare-hf --compare-no-cache
    sglbus bench offline --dataset-name random --random-input 256 --random-output 32 --compare-hf
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch

import sglbus
from benchmarks.hf_baseline import run_hf
from benchmarks.launch import append_result
from benchmarks.stack_profile import StackProfile
from benchmarks.step_trace import GcPauses, summarize, summarize_laps, triton_variants
from benchmarks.workloads import Workload, add_workload_args, build_workload, optimal_hit_rate
from services.scheduler.model_runner import resolve_device
from shared.config import EngineConfig, add_cli_args, cli_overrides

# the engine options a benchmark run may set (the rest come from SGLBUS_* or their defaults)
ENGINE_FLAGS = ("model_path", "load_format", "dtype", "device", "schedule_policy", "chunked_prefill_size",
                "max_running_requests", "max_total_tokens", "mem_fraction_static", "disable_radix_cache",
                "attention_backend", "cuda_graph_max_bs", "disable_cuda_graph",
                "disable_overlap_schedule", "enable_cascade_attention", "moe_runner_backend",
                "context_length", "tp_size")  # fmt: skip


@dataclass
class RunResult:
    backend: str
    requests: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cache_hit_rate: float | None = None
    optimal_hit_rate: float | None = None
    overhead_pct: float | None = None
    steps: int | None = None
    # CUDA only (StepTimer): GPU time of the steps as a share of the duration, and per step kind
    device_busy_pct: float | None = None
    decode_steps: int | None = None
    decode_ms: float | None = None
    extend_steps: int | None = None
    extend_ms: float | None = None

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.duration_s


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="Offline throughput benchmark for sglbus.Engine")
    add_workload_args(p)
    add_cli_args(p, EngineConfig, only=ENGINE_FLAGS)
    e = p.add_argument_group("engine")
    c = p.add_argument_group("comparisons and output")
    c.add_argument("--compare-hf", action="store_true", help="also run HF transformers on the workload")
    c.add_argument("--hf-batch-size", type=int, default=16)
    c.add_argument("--compare-no-cache", action="store_true", help="also run the engine without radix cache")
    c.add_argument("--output-file", default=None, help="append one JSONL row with all figures")
    trace_help = "CUDA: print the GPU time and idle time of the steps by kind and batch size"
    c.add_argument("--step-trace", action="store_true", help=trace_help)
    profile_help = "sample every thread's Python stack during the timed run; print the top functions"
    c.add_argument("--profile", action="store_true", help=profile_help)
    torch_help = "run torch.profiler on the scheduler thread during the timed run; print the top ops"
    c.add_argument("--torch-profile", action="store_true", help=torch_help)
    example = '{"frequency_penalty": 1.1}'
    e.add_argument("--extra-sampling-params", type=json.loads, default={},
                   help=f"JSON merged into every request's sampling_params, e.g. '{example}'")  # fmt: skip
    example = '{"return_logprob": true, "top_logprobs_num": 5}'
    e.add_argument("--extra-request-params", type=json.loads, default={},
                   help=f"JSON of Engine.generate arguments (logprob options), e.g. '{example}'")  # fmt: skip
    args = p.parse_args(argv)
    if args.disable_radix_cache and args.compare_no_cache:
        p.error("--compare-no-cache compares against the radix cache; drop --disable-radix-cache")
    return args


def run_engine(args: argparse.Namespace, disable_radix_cache: bool) -> tuple[RunResult, dict[str, Any]]:
    """One engine lifetime: build the workload, warm up, time the whole workload as one batch."""
    opts = {**cli_overrides(args, EngineConfig), "disable_radix_cache": disable_radix_cache}
    with sglbus.Engine(**opts) as engine:
        workload = build_workload(args, engine.model_config.vocab_size)
        # warmup: first-forward allocations are not throughput; flush so it feeds no cache hits
        warm = [ids[:16] for ids, _ in workload[:2]]
        engine.generate(input_ids=warm, sampling_params={"temperature": 0, "max_new_tokens": 4})
        if not engine.flush_cache():
            raise RuntimeError("flush_cache refused after the warmup: the engine still has work")
        before = engine.get_stats()
        extra = args.extra_sampling_params
        params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra} for _, n in workload]
        for p in params:  # a min_new_tokens past a request's max_new_tokens would be refused: clip it
            if "min_new_tokens" in p:
                p["min_new_tokens"] = min(p["min_new_tokens"], p["max_new_tokens"])
        if args.step_trace:
            engine._on_scheduler(lambda s: (setattr(s.timer, "trace", []), setattr(s.timer, "laps", [])))
        alloc_before = _allocator_counts()
        if args.torch_profile:
            engine._on_scheduler(_start_torch_profile)
        with (
            StackProfile() if args.profile else contextlib.nullcontext() as prof,
            GcPauses() if args.step_trace else contextlib.nullcontext() as gc_pauses,
        ):
            t0 = time.perf_counter()
            outs = engine.generate(
                input_ids=[ids for ids, _ in workload], sampling_params=params, **args.extra_request_params
            )
            duration = time.perf_counter() - t0
        if prof is not None:
            print(prof.report())
        if gc_pauses is not None:
            print(gc_pauses.report())
        if args.torch_profile:
            print(engine._on_scheduler(_stop_torch_profile))
        trace = engine._on_scheduler(lambda s: s.timer.trace) if args.step_trace else None
        if trace:
            first, last = engine._on_scheduler(lambda s: (s.timer.first_launch, s.timer.last_done))
            print(
                f"the first step launched {1e3 * (first - t0):.0f} ms after the start; the last step's ids "
                f"were on the host {1e3 * (t0 + duration - last):.0f} ms before the end"
            )
        if args.step_trace:
            print(f"KV pool {before['max_total_tokens']} tokens")
            print(summarize_laps(engine._on_scheduler(lambda s: s.timer.laps)))
        if trace:  # (empty on CPU: no device timing there)
            print(summarize(trace))
            print(engine._on_scheduler(lambda s: triton_variants()))
            launched = engine.get_stats()["overlapped_steps"] - before["overlapped_steps"]
            print(f"steps launched while the previous one ran (overlap): {launched} of {len(trace)}")
            alloc = {k: v - alloc_before[k] for k, v in _allocator_counts().items()}
            print(f"CUDA allocator during the run: {alloc['num_alloc_retries']} retries (each frees the "
                  f"cache and syncs the device), {alloc['num_device_alloc']} cudaMalloc, "
                  f"{alloc['num_device_free']} cudaFree")  # fmt: skip
        after = engine.get_stats()
        eos = engine.tokenizer.eos_token_id
        info = {
            "workload": workload,
            "model_folder": engine.model_folder,
            "pad_id": engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else eos,
            "device": resolve_device(engine.config.device),
        }
    d = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens", "steps", "forward_s", "step_s",
                                           "device_s", "device_decode_s", "device_extend_s", "decode_steps",
                                           "extend_steps")}  # fmt: skip
    on_device = d["device_s"] > 0
    aborted = [
        o["meta_info"]["finish_reason"] for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"
    ]
    if aborted:
        raise RuntimeError(f"{len(aborted)} requests aborted, e.g. {aborted[0]}; throughput would mislead")
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    if out_tokens != sum(n for _, n in workload):  # ignore_eos: only a bug can make this differ
        raise RuntimeError(
            f"the engine generated {out_tokens} tokens, not the {sum(n for _, n in workload)} asked"
        )
    result = RunResult(
        backend="sglbus" + (" (no radix cache)" if disable_radix_cache else ""),
        requests=len(outs),
        duration_s=duration,
        input_tokens=sum(o["meta_info"]["prompt_tokens"] for o in outs),
        output_tokens=out_tokens,
        cache_hit_rate=d["cached_tokens"] / max(d["prompt_tokens"], 1),
        optimal_hit_rate=optimal_hit_rate(workload),
        # everything in a step outside forward+sampling: batch selection, radix match/insert/evict,
        # KV slot bookkeeping, output messages. All scheduler overhead, so an upper bound on the radix part.
        overhead_pct=100 * (d["step_s"] - d["forward_s"]) / max(d["step_s"], 1e-9),
        steps=d["steps"],
    )
    if on_device:
        result.device_busy_pct = 100 * d["device_s"] / duration
        result.decode_steps, result.extend_steps = d["decode_steps"], d["extend_steps"]
        result.decode_ms = 1000 * d["device_decode_s"] / max(d["decode_steps"], 1)
        result.extend_ms = 1000 * d["device_extend_s"] / max(d["extend_steps"], 1)
    return result, info


_torch_profiles: list[Any] = []


def _start_torch_profile(_: Any) -> None:
    """(scheduler thread) torch.profiler records the thread it was entered on."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _torch_profiles.append(profile(activities=activities))
    _torch_profiles[-1].__enter__()


def _stop_torch_profile(_: Any) -> str:
    p = _torch_profiles.pop()
    p.__exit__(None, None, None)
    table = p.key_averages()
    parts = [table.table(sort_by="self_cpu_time_total", row_limit=30)]
    if torch.cuda.is_available():
        try:
            parts.append(table.table(sort_by="self_device_time_total", row_limit=30))
        except (AttributeError, KeyError, ValueError):  # older torch names it after CUDA
            parts.append(table.table(sort_by="self_cuda_time_total", row_limit=30))
    return "\n".join(parts)


def _allocator_counts() -> dict[str, int]:
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free")
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: stats.get(k, 0) for k in keys}


def print_block(r: RunResult) -> None:
    print("{s:=^50}".format(s=" Offline Throughput Benchmark Result "))
    rows: list[tuple[str, Any]] = [
        ("Backend:", r.backend),
        ("Successful requests:", r.requests),
        ("Benchmark duration (s):", f"{r.duration_s:.2f}"),
        ("Total input tokens:", r.input_tokens),
        ("Total generated tokens:", r.output_tokens),
        ("Request throughput (req/s):", f"{r.requests / r.duration_s:.2f}"),
        ("Input token throughput (tok/s):", f"{r.input_tokens / r.duration_s:.2f}"),
        ("Output token throughput (tok/s):", f"{r.output_tokens / r.duration_s:.2f}"),
        ("Total token throughput (tok/s):", f"{r.total_throughput:.2f}"),
    ]
    if r.cache_hit_rate is not None:
        rows += [
            ("Cache hit rate:", f"{100 * r.cache_hit_rate:.2f}%"),
            ("Optimal cache hit rate:", f"{100 * (r.optimal_hit_rate or 0):.2f}%"),
            ("Radix cache overhead (% of step time):", f"{r.overhead_pct:.2f}"),
        ]
    if r.device_busy_pct is not None:
        rows += [
            ("Device busy (% of duration):", f"{r.device_busy_pct:.1f}"),
            ("Decode steps, mean device ms:", f"{r.decode_steps}, {r.decode_ms:.2f}"),
            ("Prefill steps, mean device ms:", f"{r.extend_steps}, {r.extend_ms:.2f}"),
        ]
    for label, value in rows:
        print(f"{label:<40} {value:<10}")
    print("=" * 50)


def machine_info(device: torch.device) -> dict[str, Any]:
    try:
        # the checkout this benchmark runs from, whatever the caller's working directory
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=here
        )
        commit = rev.stdout.strip() or None
    except OSError:
        commit = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "git": commit,
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    # the machine may be shared: a busy CPU at the start explains a slow run in the recorded row
    load_at_start = os.getloadavg()[0]
    main_run, info = run_engine(args, bool(args.disable_radix_cache))
    workload: Workload = info["workload"]
    print_block(main_run)
    results = [main_run]
    ratios: dict[str, float] = {}
    if args.compare_no_cache:
        no_cache, _ = run_engine(args, disable_radix_cache=True)
        print_block(no_cache)
        ratios["sglbus / no-cache"] = main_run.total_throughput / no_cache.total_throughput
        print(f"Throughput ratio radix / no-cache:  {ratios['sglbus / no-cache']:.2f}x")
        results.append(no_cache)
    if args.compare_hf:
        hf = run_hf(info["model_folder"], workload, args.hf_batch_size, info["pad_id"], info["device"])
        hf_run = RunResult("hf-transformers", len(workload), hf.duration_s, hf.input_tokens, hf.output_tokens)
        print_block(hf_run)
        print(f"HF batches: {hf.batches} of <= {args.hf_batch_size}; wasted tokens: {hf.wasted_tokens}")
        ratios["sglbus / hf"] = main_run.total_throughput / hf_run.total_throughput
        print(f"Throughput ratio sglbus / hf:  {ratios['sglbus / hf']:.2f}x")
        results.append(hf_run)
    if args.output_file:
        machine = {**machine_info(info["device"]), "loadavg_1m_at_start": load_at_start}
        runs = [{**asdict(r), "total_throughput": r.total_throughput} for r in results]
        append_result(args.output_file, vars(args), machine, {"results": runs, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
