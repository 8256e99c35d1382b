"""The host work of a constrained step's end (`GrammarDecode`, jump-forward.py), without a model: B
requests of the JSON workload's schema, each step every row takes a random token its grammar allows
(as a model with random weights does), and the timed part is what `Scheduler._complete` does with
the step's tokens: the matchers accept them, forced continuations are found, retokenized with the
output's tail and accepted, and KV of replaced tokens is freed. Masks are filled outside the timing.

    python -m benchmarks.grammar_decode --batch 256
    python -m benchmarks.grammar_decode --model-path <folder with tokenizer.json> --vocab 128256

Prints the mean ms of that work per step, per row and per jump, and the jumps and forced tokens;
`--profile` adds the functions that took the most of it (cProfile: its overhead inflates the times).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import time

import torch

from benchmarks.constrained import SCHEMA
from services.scheduler.constrained.grammar import GrammarSpec, fill_bitmasks
from services.scheduler.constrained.jump_forward import GrammarDecode
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.request import Req
from shared.messages import GenerateReq
from shared.model_config import ModelConfig
from shared.sampling_params import SamplingParams

_EOS = 0


def _pools(batch: int, context: int) -> tuple[KVPool, ReqToTokenPool]:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position_embeddings=context, tie_word_embeddings=False)  # fmt: skip
    return KVPool(cfg, batch * context, torch.float32, "cpu"), ReqToTokenPool(batch + 1, context, "cpu")


def run(backend, vocab: int, batch: int, steps: int, jump_forward: bool, seed: int = 0, profile=None) -> dict:
    kv, table = _pools(batch, 512)
    stats = {"request_failures": 0}
    decode = GrammarDecode(kv, table, 1 << 20, (_EOS,), jump_forward, stats)
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    prompt = [1, 2, 3]
    reqs = []
    for i in range(batch):
        params = SamplingParams(max_new_tokens=200, json_schema=json.dumps(SCHEMA))
        r = Req(GenerateReq(rid=str(i), input_ids=prompt, sampling=params, out_subject=""), (_EOS,))
        r.row = table.alloc()
        r.matcher = compiled.matcher()
        decode.start(r, backend)
        reqs.append(r)
    rng, words = random.Random(seed), backend.mask_words
    host = torch.zeros((batch, words), dtype=torch.int32)
    timed, rows_done, took = 0.0, 0, 0
    for _ in range(steps):
        live = [r for r in reqs if r.finish is None]
        if not live:
            break
        for r in live:  # the previous step computed every known token's KV
            need = len(r.prompt) + len(r.output) - r.num_computed
            if need > 0:
                table.table[r.row, r.num_computed : r.num_computed + need] = kv.alloc(need)
                r.num_computed += need
        host.zero_()
        fill_bitmasks([r.matcher for r in live], host)  # type: ignore[misc]
        tokens = []
        for j in range(len(live)):
            bits = (host[j].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
            ok = bits.flatten()[:vocab].nonzero().flatten()
            tokens.append(int(ok[rng.randrange(len(ok))]) if len(ok) else _EOS)
        t = time.perf_counter()
        if profile is not None:
            profile.enable()
        decode.advance_all(list(zip(live, tokens, strict=True)), backend)
        if profile is not None:
            profile.disable()
        timed += time.perf_counter() - t
        rows_done += len(live)
        took += 1
    valid = sum(1 for r in reqs if r.finish is not None and _parses(backend, r))
    finished = sum(r.finish is not None for r in reqs)
    return dict(stats, ms_step=1e3 * timed / max(took, 1), us_row=1e6 * timed / max(rows_done, 1),
                steps=took, rows=rows_done, valid=valid, finished=finished)  # fmt: skip


def _parses(backend, r: Req) -> bool:
    out = [t for t in r.output if t != _EOS]
    try:
        json.loads(backend.decode_bytes(out).decode("utf-8"))
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    from services.scheduler.constrained.xgrammar_backend import XGrammarBackend
    from shared.model_files import resolve_model_folder

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="at most (all requests finish sooner)")
    p.add_argument("--vocab", type=int, default=None, help="bitmask width (default: the tokenizer's)")
    p.add_argument(
        "--model-path", default=None, help="a folder with tokenizer.json (default: the default model)"
    )
    p.add_argument("--profile", action="store_true", help="cProfile the timed work (the top functions)")
    args = p.parse_args(argv)
    folder = resolve_model_folder(args.model_path, need_weights=False)
    path = os.path.join(folder, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        vocab = args.vocab or len(json.load(f)["model"]["vocab"])
    backend = XGrammarBackend(path, vocab, (_EOS,))
    print(f"grammar decode host work, JSON schema, batch {args.batch}, vocab {vocab}, {os.cpu_count()} CPUs")
    for jump in (False, True):
        prof = cProfile.Profile() if args.profile else None
        s = run(backend, vocab, args.batch, args.steps, jump, profile=prof)
        jumps = s["jump_forward_steps"]
        per_jump = (s["ms_step"] * s["steps"] * 1e3 / jumps) if jumps else 0.0
        print(f"jump-forward {'on ' if jump else 'off'}: {s['ms_step']:.2f} ms/step ({s['us_row']:.1f} "
              f"us/row) over {s['steps']} steps, {jumps} jumps ({per_jump:.0f} us of step work per jump), "
              f"{s['jump_forward_tokens']} forced tokens, {s['retokenized']} retokenized; "
              f"finished {s['finished']}, valid JSON {s['valid']}", flush=True)  # fmt: skip
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
