"""Online serving benchmark (SGLang's bench_serving) against any server with SGLang's `/generate` API:
sglbus or a real SGLang server. Requests carry synthetic `input_ids` (exact lengths, the same ids as
`benchmarks.offline` for the same dataset arguments and seed), `temperature=0`, `ignore_eos=true` and
stream, so TTFT and inter-token latency come from SSE chunk arrival times.

    sglbus bench serving --dataset-name random --num-prompts 64 --random-input 128 --random-output 32 \\
        --random-range-ratio 0.5 --max-concurrency 64 --launch-server
    python -m benchmarks.serving --base-url http://127.0.0.1:30000 --dataset-name generated-shared-prefix \\
        --gsp-num-groups 4 --gsp-prompts-per-group 8 --gsp-system-prompt-len 256 --gsp-question-len 32 \\
        --gsp-output-len 16

The gsp defaults are SGLang's (64 groups x 16 prompts, 2048-token system prompts, 256 output tokens):
hours on a small CPU machine. There, use a few groups, a few hundred prefix tokens and short outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import orjson
from tqdm import tqdm

from benchmarks.launch import add_target_args, append_result, machine_info, percentile, target
from benchmarks.proc_cpu import ProcessCpu
from benchmarks.workloads import Workload, random_workload, shared_prefix_workload

_CLIENTS_START_S = 120.0  # --client-processes > 1: how long their start-up (imports) may take

# GenerateReqInput fields: an --extra-request-body key with one of these names goes to the top level of
# the request; every other key is a sampling parameter (merged into sampling_params)
_TOP_LEVEL = {"rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
              "return_text_in_logprobs", "lora_path", "image_data", "custom_logit_processor",
              "return_hidden_states", "stream"}  # fmt: skip


@dataclass
class Output:
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_len: int = 0
    text: str = ""
    error: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # the last chunk's (worker_id, cached_tokens)


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--backend", default="sglang", choices=("sglang", "sglbus"), help="both: POST /generate")
    add_target_args(s)
    s.add_argument("--tokenizer", default=None, help="folder, for retokenized counts (default: the server's)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", choices=("random", "generated-shared-prefix"), default="random")
    w.add_argument("--num-prompts", type=int, default=1000, help="random only (gsp: groups x per group)")
    w.add_argument("--random-input", type=int, default=1024)
    w.add_argument("--random-output", type=int, default=1024)
    w.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [L*r, L]")
    w.add_argument("--gsp-num-groups", type=int, default=64)
    w.add_argument("--gsp-prompts-per-group", type=int, default=16)
    w.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    w.add_argument("--gsp-question-len", type=int, default=128)
    w.add_argument("--gsp-output-len", type=int, default=256)
    w.add_argument("--seed", type=int, default=1)
    t = p.add_argument_group("traffic and output")
    t.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--extra-request-body", default=None, help="JSON, e.g. '{\"frequency_penalty\": 1.1}'")
    t.add_argument("--disable-tqdm", action="store_true")
    t.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="send the requests from this many processes (one client is ~1 core at 20k tok/s)",
    )
    t.add_argument("--sample-cpu", action="store_true",
                   help="print the CPU use of each server process and the client")  # fmt: skip
    t.add_argument("--output-file", default=None, help="append one JSONL row with all metrics")
    args = p.parse_args(argv)
    if args.client_processes < 1:
        p.error("--client-processes must be >= 1")
    return args


def build(args: argparse.Namespace, vocab_size: int) -> Workload:
    if args.dataset_name == "random":
        return random_workload(args.num_prompts, args.random_input, args.random_output,
                               args.random_range_ratio, vocab_size, args.seed)  # fmt: skip
    n = args.gsp_num_groups * args.gsp_prompts_per_group
    return shared_prefix_workload(n, args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                  args.gsp_num_groups, vocab_size, args.seed)  # fmt: skip


def split_extra(raw: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """--extra-request-body -> (top-level fields, sampling params)."""
    extra: dict[str, Any] = json.loads(raw) if raw else {}
    if not isinstance(extra, dict):
        raise SystemExit("--extra-request-body must be a JSON object")
    sampling = dict(extra.pop("sampling_params", None) or {})
    top = {k: v for k, v in extra.items() if k in _TOP_LEVEL and k != "stream"}
    sampling.update({k: v for k, v in extra.items() if k not in _TOP_LEVEL})
    return top, sampling


def load_tokenizer_and_vocab(
    args: argparse.Namespace, model_info: dict, server_info: dict
) -> tuple[Any, int]:
    from shared.tokenizer import load_tokenizer

    folder = args.tokenizer
    if folder is None:
        tp = model_info.get("tokenizer_path")
        if isinstance(tp, str) and os.path.isdir(tp):
            folder = tp
        else:
            from shared.model_files import resolve_model_folder

            folder = resolve_model_folder(None)
    tok = load_tokenizer(folder)
    vocab = server_info.get("vocab_size")
    if not isinstance(vocab, int):  # a real SGLang server: the model's config.json, else the tokenizer
        cfg = os.path.join(folder, "config.json")
        vocab = json.loads(Path(cfg).read_text())["vocab_size"] if os.path.isfile(cfg) else len(tok)
    return tok, vocab


async def send(session: aiohttp.ClientSession, url: str, ids: list[int], n_out: int,
               top: dict[str, Any], sampling: dict[str, Any]) -> Output:  # fmt: skip
    sp = {"temperature": 0.0, "max_new_tokens": n_out, "ignore_eos": True, **sampling}
    payload = {"input_ids": ids, "sampling_params": sp, "stream": True, **top}
    out = Output()
    st = last_t = time.perf_counter()
    last_n = 0
    try:
        headers = {"Content-Type": "application/json"}
        async with session.post(url, data=orjson.dumps(payload), headers=headers) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:300]}"
                return out
            async for raw in _lines(r.content):
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    out.success = not out.error
                    break
                obj = orjson.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"])
                    continue
                now = time.perf_counter()
                meta = out.meta = obj.get("meta_info") or {}
                n = meta.get("completion_tokens", len(obj.get("output_ids") or []))
                if n > last_n:
                    if last_n == 0:
                        out.ttft = now - st
                    else:  # a chunk with k new tokens: k gaps of (chunk gap / k), as SGLang does
                        out.itl.extend([(now - last_t) / (n - last_n)] * (n - last_n))
                    last_t, last_n = now, n
                out.text = obj.get("text", out.text)
                reason = meta.get("finish_reason") or {}
                if reason.get("type") == "abort":
                    out.error = f"aborted: {reason.get('message')}"
        out.latency = time.perf_counter() - st
        out.output_len = last_n
    except (TimeoutError, aiohttp.ClientError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines, whatever their length (aiohttp's own line reader refuses lines past its
    buffer; a chunk of cumulative text with logprobs can be longer)."""
    rest = b""
    async for piece in content.iter_any():
        *lines, rest = (rest + piece).split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest


async def arrivals(workload: Workload, rate: float, seed: int) -> AsyncIterator[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    for item in workload:
        yield item
        if rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def warmup(session: aiohttp.ClientSession, base: str, workload: Workload) -> None:
    """As benchmarks.offline: 2 short prompts x 4 tokens, then flush so the warmup feeds no cache hits."""
    body = {"input_ids": [ids[:16] for ids, _ in workload[:2]],
            "sampling_params": {"temperature": 0, "max_new_tokens": 4}}  # fmt: skip
    async with session.post(base + "/generate", json=body) as r:
        r.raise_for_status()
    for _ in range(50):  # the cache refuses to flush while a request still runs
        async with session.post(base + "/flush_cache") as r:
            if r.status == 200:
                return
        await asyncio.sleep(0.1)
    print("warning: /flush_cache kept failing; the run may see warmup cache hits", file=sys.stderr)


def _session() -> aiohttp.ClientSession:
    # aiohttp, as SGLang's bench_serving: its C parser keeps one client process ahead of ~20k streamed
    # tokens a second, where httpx's pure-Python one held a core and paced the whole served run
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20)


async def _warmup(base: str, workload: Workload) -> None:
    async with _session() as client:
        await warmup(client, base, workload)


def warm_up(base: str, workload: Workload) -> None:
    """`warmup` from a session of its own: two short prompts, then the cache flushed."""
    asyncio.run(_warmup(base, workload))


async def _send_all(
    args: argparse.Namespace, base: str, workload: Workload, start: float, index: int
) -> tuple[list[Output], float]:
    """Client `index` of --client-processes: its share of the arrivals from `start` on; its outputs
    and when the last one ended."""
    top, sampling = split_extra(args.extra_request_body)
    n = args.client_processes
    async with _session() as client:
        mc = args.max_concurrency
        sem = asyncio.Semaphore(-(-mc // n)) if mc else None
        pbar = tqdm(total=len(workload), disable=args.disable_tqdm or n > 1)

        async def one(ids: list[int], n_out: int) -> Output:
            if sem is None:
                out = await send(client, base + "/generate", ids, n_out, top, sampling)
            else:
                async with sem:
                    out = await send(client, base + "/generate", ids, n_out, top, sampling)
            pbar.update(1)
            return out

        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        arriving = arrivals(workload, args.request_rate / n, args.seed + index)
        tasks = [asyncio.create_task(one(ids, n_out)) async for ids, n_out in arriving]
        outputs = await asyncio.gather(*tasks)
        end = time.perf_counter()
        pbar.close()
    return list(outputs), end


def _client_process(
    args: argparse.Namespace, base: str, workload: Workload, index: int, ready: Any, go: Any, results: Any
) -> None:
    """One of --client-processes (spawned: no locks of the parent's threads come along): ready, then
    its share of the requests from the parent's go."""
    ready.wait()
    go.wait()
    results.put((index, asyncio.run(_send_all(args, base, workload, time.perf_counter(), index))))


def benchmark(args: argparse.Namespace, base: str, workload: Workload) -> tuple[list[Output], float]:
    """`warm_up`, then `send_workload`."""
    warm_up(base, workload)
    return send_workload(args, base, workload)


def send_workload(args: argparse.Namespace, base: str, workload: Workload) -> tuple[list[Output], float]:
    """All requests, from one client process or from --client-processes of them (each every n-th
    request, all released together once they have started); the outputs in workload order and the
    duration from the start to the last output. Reads args.client_processes, max_concurrency,
    request_rate, seed, extra_request_body and disable_tqdm."""
    n = args.client_processes
    if n == 1:
        start = time.perf_counter()
        outputs, end = asyncio.run(_send_all(args, base, workload, start, 0))
        return outputs, end - start
    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Barrier(n + 1), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(args, base, workload[i::n], i, ready, go, results),
                         daemon=True) for i in range(n)]  # fmt: skip
    for proc in procs:
        proc.start()
    ready.wait(_CLIENTS_START_S)
    start = time.perf_counter()
    go.set()
    parts: dict[int, tuple[list[Output], float]] = {}
    while len(parts) < n:
        try:
            index, part = results.get(timeout=1.0)
            parts[index] = part
        except queue.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                raise RuntimeError("a client process died") from None
    for proc in procs:
        proc.join()
    outputs: list[Output] = [Output()] * len(workload)
    for i, (outs, _) in parts.items():
        outputs[i::n] = outs
    return outputs, max(end for _, end in parts.values()) - start


def metrics(workload: Workload, outputs: list[Output], duration: float, tok: Any) -> dict[str, Any]:
    ok = [(ids, o) for (ids, _), o in zip(workload, outputs, strict=True) if o.success]
    lat = [o.latency * 1000 for _, o in ok]
    ttft = [o.ttft * 1000 for _, o in ok]
    itl = [x * 1000 for _, o in ok for x in o.itl]
    total_in = sum(len(ids) for ids, _ in ok)
    total_out = sum(o.output_len for _, o in ok)
    retok = sum(len(tok.encode(o.text, add_special_tokens=False)) for _, o in ok)
    return {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_output_tokens_retokenized": retok,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(lat) / 1000 / duration,
        "mean_e2e_latency_ms": float(np.mean(lat)) if lat else 0.0,
        "median_e2e_latency_ms": percentile(lat, 50),
        "mean_ttft_ms": float(np.mean(ttft)) if ttft else 0.0,
        "median_ttft_ms": percentile(ttft, 50),
        "p99_ttft_ms": percentile(ttft, 99),
        "mean_itl_ms": float(np.mean(itl)) if itl else 0.0,
        "median_itl_ms": percentile(itl, 50),
        "p95_itl_ms": percentile(itl, 95),
        "p99_itl_ms": percentile(itl, 99),
        "max_itl_ms": max(itl, default=0.0),
    }


def print_block(args: argparse.Namespace, m: dict[str, Any]) -> None:
    def row(label: str, value: Any) -> None:
        print(("{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}").format(label, value))

    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Backend:", args.backend))
    print("{:<40} {:<10}".format("Traffic request rate:", args.request_rate))
    print("{:<40} {:<10}".format("Max request concurrency:", args.max_concurrency or "not set"))
    for label, key in [("Successful requests:", "completed"), ("Benchmark duration (s):", "duration_s"),
                       ("Total input tokens:", "total_input_tokens"),
                       ("Total generated tokens:", "total_output_tokens"),
                       ("Total generated tokens (retokenized):", "total_output_tokens_retokenized"),
                       ("Request throughput (req/s):", "request_throughput"),
                       ("Input token throughput (tok/s):", "input_throughput"),
                       ("Output token throughput (tok/s):", "output_throughput"),
                       ("Total token throughput (tok/s):", "total_throughput"),
                       ("Concurrency:", "concurrency")]:  # fmt: skip
        row(label, m[key])
    sections = [
        ("End-to-End Latency", [("Mean E2E Latency (ms):", "mean_e2e_latency_ms"),
                                ("Median E2E Latency (ms):", "median_e2e_latency_ms")]),
        ("Time to First Token", [("Mean TTFT (ms):", "mean_ttft_ms"), ("Median TTFT (ms):", "median_ttft_ms"),
                                 ("P99 TTFT (ms):", "p99_ttft_ms")]),
        ("Inter-Token Latency", [("Mean ITL (ms):", "mean_itl_ms"), ("Median ITL (ms):", "median_itl_ms"),
                                 ("P95 ITL (ms):", "p95_itl_ms"), ("P99 ITL (ms):", "p99_itl_ms"),
                                 ("Max ITL (ms):", "max_itl_ms")]),
    ]  # fmt: skip
    for title, rows in sections:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for label, key in rows:
            row(label, m[key])
    print("=" * 50)


def run(args: argparse.Namespace, base: str, server_pid: int | None = None) -> dict[str, Any]:
    model_info = httpx.get(base + "/get_model_info", timeout=30).json()
    r = httpx.get(base + "/get_server_info", timeout=30)
    server_info = r.json() if r.status_code == 200 else {}
    tok, vocab = load_tokenizer_and_vocab(args, model_info, server_info)
    workload = build(args, vocab)
    with ProcessCpu(server_pid) if args.sample_cpu else contextlib.nullcontext() as cpu:
        outputs, duration = benchmark(args, base, workload)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} requests failed, e.g. {failed[0]}", file=sys.stderr)
    m = metrics(workload, outputs, duration, tok)
    print_block(args, m)
    if cpu is not None:
        print(cpu.report())
    # sglbus servers: the scheduler's counters over the run (warmup included), e.g. the prefix cache hits
    r = httpx.get(base + "/get_server_info", timeout=30)
    after = r.json().get("stats") if r.status_code == 200 else None
    before = server_info.get("stats")
    stats = {k: after[k] - before[k] for k in after if k in before} if after and before else None
    if stats and stats.get("device_s"):  # CUDA: how busy the scheduler kept the GPU
        print(f"scheduler: {stats['steps']} steps, device busy {stats['device_s']:.2f} s of "
              f"{duration:.2f} s ({100 * stats['device_s'] / duration:.1f}%)")  # fmt: skip
    return {"model_path": model_info.get("model_path"), "metrics": m, "server_stats": stats,
            "errors": failed[:5]}  # fmt: skip


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    machine = machine_info()
    with target(args) as server:
        result = run(args, server.base, server.pid)
    if args.output_file:
        append_result(
            args.output_file, {**vars(args), "request_rate": str(args.request_rate)}, machine, result
        )
    return 0 if result["metrics"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
