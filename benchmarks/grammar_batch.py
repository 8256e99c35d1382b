"""The grammar bitmask of a whole decode batch: B matchers of the JSON workload's schema walk random
valid paths (each step takes a random allowed token per row, as a model with random weights does)
and every step fills all B masks at once. Per backend: llguidance's batched fill on its thread pool
and xgrammar's batched fill, each with `--threads` (0: the library's own choice); for xgrammar also
the rows' accept + forced-string + done work of a step over as many Python threads. Each backend
walks its own matchers in its own pass; the first steps (warm caches) are left out.

    python -m benchmarks.grammar_batch --batch 256 --vocab 128256 --threads 1 4 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from benchmarks.constrained import SCHEMA

_SKIP = 3


def _allowed(row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def _walk(fill, accept, done, batch: int, vocab: int, steps: int) -> float:
    """Mean ms per batched fill over steps (after _SKIP); accept(j, token) advances row j."""
    rng, words = random.Random(0), (vocab + 31) // 32
    host, times = torch.zeros((batch, words), dtype=torch.int32), []
    for _ in range(steps + _SKIP):
        host.zero_()
        t = time.perf_counter()
        fill(host)
        times.append(time.perf_counter() - t)
        for j in range(batch):
            ok = _allowed(host[j], vocab)
            if not done(j) and len(ok):
                accept(j, int(ok[rng.randrange(len(ok))]))
    return 1e3 * sum(times[_SKIP:]) / steps


def llguidance_pass(folder: str, vocab: int, batch: int, steps: int, threads: int) -> float:
    import llguidance

    from services.scheduler.constrained.llguidance_backend import LLGuidanceBackend
    from shared.grammar_text import grammar_text

    backend = LLGuidanceBackend(os.path.join(folder, "tokenizer.json"), vocab, ())
    grammar = llguidance.LLMatcher(backend.tokenizer, grammar_text("json_schema", json.dumps(SCHEMA)))
    ms = [grammar.deep_copy() for _ in range(batch)]
    ex = llguidance.LLExecutor(threads or None)

    def fill(host: torch.Tensor) -> None:
        ex.unsafe_compute_mask_ptr(
            [(m, j) for j, m in enumerate(ms)], host.data_ptr(), host.shape[1] * 4, batch
        )

    return _walk(fill, lambda j, t: ms[j].consume_token(t), lambda j: ms[j].is_stopped(), batch, vocab, steps)


def xgrammar_pass(folder: str, vocab: int, batch: int, steps: int, threads: int) -> tuple[float, float]:
    """(ms per batched fill, ms per step of the rows' accept + forced-string work): the fill on
    BatchGrammarMatcher(max_threads=threads, 0: 'auto'), the matcher work split over `threads`
    Python threads as the scheduler's GrammarDecode.consume splits it (1: one by one)."""
    from concurrent.futures import ThreadPoolExecutor

    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(folder), vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    ms = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    batcher = xgr.BatchGrammarMatcher(max_threads=threads or "auto")
    fill = lambda host: batcher.batch_fill_next_token_bitmask(ms, host)  # noqa: E731
    pool, work = ThreadPoolExecutor(max(threads, 1)), [0.0]
    pending: list[tuple[int, int]] = []

    def rows(chunk: list[tuple[int, int]]) -> None:
        for j, t in chunk:
            ms[j].accept_token(t)
            ms[j].find_jump_forward_string()
            ms[j].is_terminated()

    def accept(j: int, t: int) -> None:  # collects the step's tokens; the last row runs them all
        pending.append((j, t))
        if len(pending) < batch:
            return
        start, size = time.perf_counter(), -(-batch // max(threads, 1))
        list(pool.map(rows, [pending[i : i + size] for i in range(0, batch, size)]))
        work[0] += time.perf_counter() - start
        pending.clear()

    fill_ms = _walk(fill, accept, lambda j: ms[j].is_terminated(), batch, vocab, steps)
    return fill_ms, 1e3 * work[0] / (steps + _SKIP)


def main(argv: list[str] | None = None) -> None:
    from shared.model_files import resolve_model_folder

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=None, help="bitmask width (default: the tokenizer's)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--threads", type=int, nargs="+", default=[0], help="thread counts to try; 0: each library's default"
    )
    p.add_argument(
        "--model-path", default=None, help="a folder with tokenizer.json (default: the default model)"
    )
    args = p.parse_args(argv)
    folder = resolve_model_folder(args.model_path, need_weights=False)
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        vocab = args.vocab or len(json.load(f)["model"]["vocab"])
    print(f"JSON schema masks, batch {args.batch}, vocab {vocab}, {os.cpu_count()} CPUs, {args.steps} steps")
    for n in args.threads:
        ms = llguidance_pass(folder, vocab, args.batch, args.steps, n)
        per_row = 1e3 * ms / args.batch
        print(f"llguidance, {n or 'default'} threads: {ms:.2f} ms per batched fill ({per_row:.1f} us/row)")
    for n in args.threads:
        try:
            ms, work = xgrammar_pass(folder, vocab, args.batch, args.steps, n)
        except ImportError as e:
            print(f"xgrammar: not installed ({e})")
            break
        print(
            f"xgrammar, {n or 'default'} threads: {ms:.2f} ms per batched fill ({1e3 * ms / args.batch:.1f} "
            f"us/row); accept + forced + done {work:.2f} ms per step ({1e3 * work / args.batch:.1f} us/row)"
        )


if __name__ == "__main__":
    main()
