"""Routing benchmark (issue 32): a multi-tenant shared-prefix workload against `sglbus serve --dp-size M
--router-policy P`, a fresh server for each M and policy, through the public HTTP API (streamed
/generate with input_ids, as benchmarks/serving.py sends).

The workload: G groups, each a system prompt of S tokens, Q questions per group of L tokens, O output
tokens; the prompts of all groups are shuffled together with --seed (workloads.shared_prefix_workload),
so they arrive interleaved across groups, at --request-rate (Poisson) and/or --max-concurrency.
`--dataset random` sends prompts of the same lengths without shared prefixes: the cost of M workers
sharing one device, whatever the policy.

Per (M, policy): cache hit rate (cached / prompt tokens over the responses' meta_info), prefill tokens
computed (prompt - cached), requests per worker (meta_info.worker_id) and max/mean, groups served by
more than one worker, the router's decisions (/get_server_info), output tok/s, streamed TTFT p50/p90.
At M = 1 one run stands for every policy (there is nothing to route). The table adds each row's hit
rate over M = 1's and its prefill over round robin's at the same M (the issue's targets: >= 0.9 and
<= 0.5, and max/mean <= 1.3).

    python -m benchmarks.routing --tiny --server-args "--max-total-tokens 65536"
    python -m benchmarks.routing --tiny --dataset random --workers 1,4 --policies round_robin \\
        --server-args "--max-total-tokens 65536"

--tiny: a 2-layer Llama of hidden size 64 with random weights (--load-format dummy) and the default
model's tokenizer, built in a temporary folder: hit rates, prefill computed and balance do not depend
on the weights, and two CPU cores run the whole matrix in minutes. --max-total-tokens is the KV pool
of all workers together: serve gives each of M workers 1/M of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import httpx

from benchmarks.launch import LaunchedServer, append_result, machine_info, percentile
from benchmarks.serving import Output, send_workload, warm_up
from benchmarks.workloads import Workload, optimal_hit_rate, random_workload, shared_prefix_workload

_WORKERS_READY_S = 120.0  # after /health: every worker's scheduler, detokenizer and KV events seen
# the router counts a routed prompt's blocks as held for 1 s after its first output (router.py's
# RELEASE_GRACE_S), a flush notwithstanding: the warmup's prompts must not look held in the run
_OVERLAY_GRACE_S = 1.5
# prompt ids are drawn below this: valid for every vocabulary we serve (Llama-2's is the smallest)
_WORKLOAD_VOCAB = 32000

# the tiny model: routing figures depend on the tokens, never on the weights
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4", help="values of M (--dp-size), comma separated")
    p.add_argument("--policies", default="cache_aware,round_robin,least_load,random,shared",
                   help="--router-policy values, comma separated")  # fmt: skip
    p.add_argument(
        "--server-args",
        default="",
        help='passed to every `sglbus serve`, e.g. "--max-total-tokens 65536" (all workers\' KV)',
    )
    p.add_argument("--tiny", action="store_true", help="serve a tiny dummy Llama (see above)")
    p.add_argument("--server-log-dir", default=None, help="keep each server's log here")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=("shared-prefix", "random"), default="shared-prefix")
    w.add_argument("--num-groups", type=int, default=32, help="G: groups, each its own system prompt")
    w.add_argument("--system-prompt-len", type=int, default=1024, help="S: tokens of a system prompt")
    w.add_argument("--questions-per-group", type=int, default=16, help="Q")
    w.add_argument("--question-len", type=int, default=32, help="L: tokens of a question")
    w.add_argument("--output-len", type=int, default=16, help="O: output tokens (ignore_eos)")
    w.add_argument("--seed", type=int, default=1, help="prompts, arrival order and Poisson gaps")
    w.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    w.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-file", default=None, help="append one JSONL row per (M, policy)")
    p.add_argument("--per-request", action="store_true",
                   help="the rows also list each request, in arrival order: [group (its system prompt by "
                        "first arrival; -1: random), worker, prompt, cached, ttft_s]")  # fmt: skip
    args = p.parse_args(argv)
    args.worker_counts = [int(x) for x in args.workers.split(",")]
    args.policy_list = [x.strip() for x in args.policies.split(",") if x.strip()]
    if args.tiny and "--model-path" in shlex.split(args.server_args):
        p.error("--tiny serves its own model: leave --model-path out of --server-args")
    # what serving.send_workload reads
    args.client_processes, args.extra_request_body = 1, None
    return args


def tiny_model(folder: str) -> str:
    """A config-only Llama folder for --load-format dummy, with the default model's tokenizer."""
    from shared.model_files import TOKENIZER_FILES, resolve_model_folder

    source = resolve_model_folder(None, need_weights=False)
    for name in TOKENIZER_FILES:
        if os.path.isfile(src := os.path.join(source, name)):
            shutil.copy(src, os.path.join(folder, name))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f, indent=1)
    return folder


def build_workload(args: argparse.Namespace) -> Workload:
    n, vocab = args.num_groups * args.questions_per_group, _WORKLOAD_VOCAB
    if args.dataset == "random":  # range ratio 1: every prompt exactly S + L tokens
        return random_workload(n, args.system_prompt_len + args.question_len, args.output_len, 1.0, vocab,
                               args.seed)  # fmt: skip
    return shared_prefix_workload(n, args.system_prompt_len, args.question_len, args.output_len,
                                  args.num_groups, vocab, args.seed)  # fmt: skip


def server_info(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/get_server_info", timeout=30)
    r.raise_for_status()
    return r.json()


def wait_for_workers(base: str, m: int) -> dict[str, Any]:
    """/health answers once one worker serves; the router must know all m before the run."""
    deadline = time.monotonic() + _WORKERS_READY_S
    while True:
        info = server_info(base)
        states = info.get("internal_states", [])
        if (len(states) == m and all(s.get("detokenizer_alive") for s in states)
                and len(info["router"]["workers"]) == m):  # fmt: skip
            return info
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(states)} of {m} workers came up: {info.get('router')}")
        time.sleep(0.5)


def run_one(args: argparse.Namespace, m: int, policy: str, workload: Workload) -> dict[str, Any]:
    extra = f"{args.server_args} --dp-size {m} --router-policy {policy}"
    log = None
    if args.server_log_dir:
        os.makedirs(args.server_log_dir, exist_ok=True)
        log = os.path.join(args.server_log_dir, f"{args.dataset}-M{m}-{policy}.log")
    with LaunchedServer(extra, log_path=log) as server:
        wait_for_workers(server.url, m)
        warm_up(server.url, workload)  # two short prompts, then the cache flushed
        time.sleep(_OVERLAY_GRACE_S)
        before = server_info(server.url)
        outputs, duration = send_workload(args, server.url, workload)
        after = server_info(server.url)
    return figures(args, m, policy, workload, outputs, duration, before, after)


def figures(args: argparse.Namespace, m: int, policy: str, workload: Workload, outputs: list[Output],
            duration: float, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    ok = [(ids, o) for (ids, _), o in zip(workload, outputs, strict=True) if o.success]
    prompt = sum(o.meta.get("prompt_tokens", len(ids)) for ids, o in ok)
    cached = sum(o.meta.get("cached_tokens", 0) for _, o in ok)
    per_worker = Counter(str(o.meta.get("worker_id")) for _, o in ok)
    counts = [per_worker.get(str(i), 0) for i in range(m)]
    groups: dict[tuple[int, ...], set[str]] = {}
    if args.dataset == "shared-prefix":
        for ids, o in ok:
            groups.setdefault(tuple(ids[: args.system_prompt_len]), set()).add(str(o.meta.get("worker_id")))
    ttft = [o.ttft for _, o in ok]
    r0, r1 = before["router"], after["router"]
    return {
        "dataset": args.dataset, "workers": m, "policy": policy,
        "completed": len(ok), "failed": len(outputs) - len(ok),
        "errors": [o.error for o in outputs if not o.success][:5],
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "optimal_hit_rate": optimal_hit_rate(workload),
        "prefill_computed": prompt - cached,
        "requests_per_worker": counts,
        "max_over_mean": max(counts) / (sum(counts) / m) if sum(counts) else 0.0,
        "groups_on_several_workers": sum(len(ws) > 1 for ws in groups.values()),
        "max_groups_on_a_worker": max(Counter(w for ws in groups.values() for w in ws).values(), default=0),
        "decisions": {k: r1["decisions"][k] - r0["decisions"].get(k, 0) for k in r1["decisions"]},
        "router_routed": {w: v["routed"] - r0["workers"].get(w, {}).get("routed", 0)
                          for w, v in r1["workers"].items()},
        "kv_per_worker": [s.get("max_total_tokens") for s in after["internal_states"]],
        "scheduler_stats": _stats_delta(before, after),
        "duration_s": duration,
        "output_throughput": sum(o.output_len for _, o in ok) / duration,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "e2e_p50_s": percentile([o.latency for _, o in ok], 50),
        **({"requests": per_request(args, workload, outputs)} if args.per_request else {}),
    }  # fmt: skip


def per_request(args: argparse.Namespace, workload: Workload, outputs: list[Output]) -> list[list[Any]]:
    first: dict[tuple[int, ...], int] = {}
    out = []
    for (ids, _), o in zip(workload, outputs, strict=True):
        group = first.setdefault(tuple(ids[: args.system_prompt_len]), len(first))
        out.append([group if args.dataset == "shared-prefix" else -1, o.meta.get("worker_id"),
                    o.meta.get("prompt_tokens"), o.meta.get("cached_tokens"), round(o.ttft, 4)])  # fmt: skip
    return out


def _stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The schedulers' own counters over the run, summed over workers (a cross-check of the responses)."""
    keys = ("prompt_tokens", "cached_tokens", "generated_tokens", "retractions", "request_failures")
    total = {k: 0 for k in keys}
    for info, sign in ((after, 1), (before, -1)):
        for state in info["internal_states"]:
            for k in keys:
                total[k] += sign * state.get("stats", {}).get(k, 0)
    return total


def print_table(rows: list[dict[str, Any]]) -> None:
    """One markdown row per run; hit/M1 against M = 1 of the same dataset, prefill/RR against round
    robin at the same M (blank where that run is missing)."""
    base = {r["dataset"]: r["hit_rate"] for r in rows if r["workers"] == 1}
    rr = {(r["dataset"], r["workers"]): r["prefill_computed"] for r in rows
          if r["policy"] == "round_robin" and r["workers"] > 1}  # fmt: skip
    head = ("dataset", "M", "policy", "ok/fail", "hit %", "hit/M1", "prefill computed", "prefill/RR",
            "req per worker", "max/mean", "split groups", "hit/miss/imb/shared", "out tok/s",
            "TTFT p50/p90 s")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        m1, rr_m = base.get(r["dataset"]), rr.get((r["dataset"], r["workers"]))
        d = r["decisions"]
        cells = (r["dataset"], r["workers"], r["policy"] if r["workers"] > 1 else "(any)",
                 f"{r['completed']}/{r['failed']}", f"{100 * r['hit_rate']:.1f}",
                 f"{r['hit_rate'] / m1:.2f}" if m1 else "", f"{r['prefill_computed']:,}",
                 f"{r['prefill_computed'] / rr_m:.2f}" if rr_m else "",
                 "/".join(map(str, r["requests_per_worker"])), f"{r['max_over_mean']:.2f}",
                 r["groups_on_several_workers"] if r["dataset"] == "shared-prefix" else "",
                 f"{d['hit']}/{d['miss']}/{d['imbalance']}/{d['shared']}", f"{r['output_throughput']:.0f}",
                 f"{r['ttft_p50_s']:.2f}/{r['ttft_p90_s']:.2f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload, rows = build_workload(args), []
    with tempfile.TemporaryDirectory(prefix="sglbus-tiny-") as tmp:
        if args.tiny:
            args.server_args += f" --model-path {tiny_model(tmp)} --load-format dummy"
        for m in args.worker_counts:
            for policy in args.policy_list[:1] if m == 1 else args.policy_list:
                machine = machine_info()  # at launch: the commit this server runs
                row = run_one(args, m, policy, workload)
                rows.append(row)
                print(f"M={m} {policy}: hit {100 * row['hit_rate']:.1f}%, prefill {row['prefill_computed']:,}"
                      f", per worker {row['requests_per_worker']}, {row['failed']} failed, "
                      f"{row['duration_s']:.1f} s", flush=True)  # fmt: skip
                if args.output_file:
                    append_result(args.output_file, {**vars(args), "request_rate": str(args.request_rate)},
                                  machine, row)  # fmt: skip
    print_table(rows)
    return 0 if all(r["completed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
