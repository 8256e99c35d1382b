"""Benchmark workloads: lists of (input_ids, output_len), deterministic for a given seed.

Prompts are synthetic token ids drawn uniformly from [FIRST_SAFE_ID, vocab_size). Ids below 100 hold
the special and control tokens of the tokenizers we serve (SmolLM2: 0..16), which could end a
sequence or switch a chat template's role; skipping them keeps the model on ordinary text tokens. Raw
ids are used as they are (no decode/re-encode round trip) so input lengths are exact, and the engine and
the HF baseline see exactly the same tokens.

- `random`: SGLang's random dataset: input lengths uniform in [L*r, L], output lengths in [O*r, O].
- `shared-prefix`: few-shot style (MMLU 5-shot, SGLang's generated-shared-prefix): `num_groups` long
  prefixes, each followed by different short questions; prompts of all groups are shuffled together,
  as SGLang does, so the arrival order does not line groups up for the scheduler.
"""

from __future__ import annotations

import argparse
import random

Workload = list[tuple[list[int], int]]
FIRST_SAFE_ID = 100
DATASETS = ("random", "shared-prefix")


def random_workload(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    out: Workload = []
    for _ in range(num_prompts):
        # max(.., 1) as in SGLang: ratio 0 must not produce empty prompts or zero-token outputs
        n_in = rng.randint(max(int(input_len * range_ratio), 1), input_len)
        n_out = rng.randint(max(int(output_len * range_ratio), 1), output_len)
        out.append((_ids(rng, n_in, vocab_size), n_out))
    return out


def shared_prefix_workload(
    num_prompts: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    num_groups: int,
    vocab_size: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    # round robin, so groups differ in size by at most one prompt
    out: Workload = [
        (prefixes[i % num_groups] + _ids(rng, question_len, vocab_size), output_len)
        for i in range(num_prompts)
    ]
    rng.shuffle(out)
    return out


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_SAFE_ID, vocab_size) for _ in range(n)]


def optimal_hit_rate(workload: Workload) -> float:
    """Share of prompt tokens an ideal prefix cache serves: for each prompt, its longest common prefix
    with any earlier prompt (SGLang paper's optimum), capped at len-1 because the last prompt token is
    always computed to produce the first output's logits (the engine never caches it either).

    A token trie walked once per prompt: O(total prompt tokens). The uncapped total equals
    (prompt tokens - trie size) whatever the order; the cap makes it slightly order dependent."""
    root: dict[int, dict] = {}
    total = cached = 0
    for ids, _ in workload:
        node, lcp = root, 0
        for tok in ids:
            child = node.get(tok)
            if child is None:
                break
            node, lcp = child, lcp + 1
        for tok in ids[lcp:]:
            node = node.setdefault(tok, {})
        total += len(ids)
        cached += min(lcp, len(ids) - 1)
    return cached / total if total else 0.0


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASETS, default="shared-prefix")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--random-input", type=int, default=256, help="random: max input length")
    g.add_argument("--random-output", type=int, default=64, help="random: max output length")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.5,
        help="random: lengths uniform in [len*ratio, len] (SGLang's default is 0.0)",
    )
    g.add_argument("--shared-prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    g.add_argument("--question-len", type=int, default=32, help="shared-prefix: question tokens")
    g.add_argument("--output-len", type=int, default=8, help="shared-prefix: output tokens")
    g.add_argument("--num-groups", type=int, default=1, help="shared-prefix: groups, each its own prefix")


def build_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    if args.dataset_name == "random":
        return random_workload(
            args.num_prompts,
            args.random_input,
            args.random_output,
            args.random_range_ratio,
            vocab_size,
            args.seed,
        )
    return shared_prefix_workload(
        args.num_prompts,
        args.shared_prefix_len,
        args.question_len,
        args.output_len,
        args.num_groups,
        vocab_size,
        args.seed,
    )
