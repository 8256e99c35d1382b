"""The engine on CUDA with the default model (skipped without a GPU). The rest of the engine suite
runs on the GPU too with `SGLBUS_DEVICE=cuda SGLBUS_DTYPE=float32 SGLBUS_MAX_TOTAL_TOKENS=65536 pytest
tests/engine` (a fixed pool: each test module keeps several engines alive at once; parity with
HF, penalties, logprobs, n > 1, seeds, stop strings, chunked prefill, retraction, faults).

Checked here: the triton backend (CUDA graphs on) gives the torch backend's greedy tokens in fp32;
CUDA graphs change nothing; bf16 output logprobs stay within BF16_LOGPROB_TOL of fp32's.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time",
    "A long list of things to remember before travelling: passport, tickets, charger, adapter, "
    "toothbrush, medicine, a book for the flight, snacks, water bottle, headphones, a light jacket.",
    "1, 1, 2, 3, 5, 8, 13,",
]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
# |logprob(bf16) - logprob(fp32)| of the fp32 run's own greedy tokens, while both agree on the tokens
BF16_LOGPROB_TOL = 0.35


def greedy(make_engine, prompts=PROMPTS, **options):
    # several engines live in one process here: a fixed pool each, not a share of the free memory
    engine = make_engine(device="cuda", max_total_tokens=65536, **options)
    return engine.generate(prompts, [GREEDY] * len(prompts), return_logprob=True)


def ids(outs):
    return [o["output_ids"] for o in outs]


def test_triton_matches_torch_in_fp32(make_engine):
    ref = greedy(make_engine, attention_backend="torch", dtype="float32")
    got = greedy(make_engine, attention_backend="triton", dtype="float32")
    assert ids(got) == ids(ref)


def test_cuda_graphs_change_nothing(make_engine):
    eager = greedy(make_engine, dtype="float32", disable_cuda_graph=True)
    graphed = greedy(make_engine, dtype="float32")
    assert ids(graphed) == ids(eager)
    # a batch size between two graph buckets (padding rows) and one above the largest graph
    many = [f"Item {i}: the colour of the sky is" for i in range(40)]
    assert ids(greedy(make_engine, many, dtype="float32", cuda_graph_max_bs=16)) == ids(
        greedy(make_engine, many, dtype="float32", disable_cuda_graph=True)
    )


def test_bf16_stays_close_to_fp32(make_engine):
    ref = greedy(make_engine, dtype="float32")
    got = greedy(make_engine, dtype="bfloat16")
    for g, r in zip(got, ref, strict=True):
        lr = [lp for lp, *_ in r["meta_info"]["output_token_logprobs"]]
        lg = [lp for lp, *_ in g["meta_info"]["output_token_logprobs"]]
        pairs = zip(g["output_ids"], r["output_ids"], strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(lr))
        assert same >= 4, "bf16 diverged from fp32 within 4 tokens"
        assert max(abs(a - b) for a, b in zip(lg[:same], lr[:same], strict=True)) < BF16_LOGPROB_TOL
