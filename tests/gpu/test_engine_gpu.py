"""The engine on CUDA with the default model (skipped without a GPU). The rest of the engine suite
runs on the GPU too with `SGLBUS_DEVICE=cuda SGLBUS_DTYPE=float32 SGLBUS_MAX_TOTAL_TOKENS=65536 pytest
tests/engine` (a fixed pool: each test module keeps several engines alive at once; parity with
HF, penalties, logprobs, n > 1, seeds, stop strings, chunked prefill, retraction, faults).

Checked here: the triton backend (CUDA graphs on) gives the torch backend's greedy tokens in fp32
(parting only at a near tie, FP32_TIE); CUDA graphs change nothing (the same); bf16 output logprobs
stay within BF16_LOGPROB_TOL of fp32's.
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
# two fp32 implementations (other kernels, other reduction orders) may only part at a near tie: where
# the reference's top two logprobs are this close
FP32_TIE = 1e-4


def greedy(make_engine, prompts=PROMPTS, **options):
    # several engines live in one process here: a fixed pool each, not a share of the free memory
    engine = make_engine(device="cuda", max_total_tokens=65536, **options)
    return engine.generate(prompts, [GREEDY] * len(prompts), return_logprob=True, top_logprobs_num=2)


def assert_same_greedy(got, ref):
    """Token for token, except after a near tie of the reference (then the rest is not compared)."""
    for k, (g, r) in enumerate(zip(got, ref, strict=True)):
        a, b = g["output_ids"], r["output_ids"]
        assert len(a) == len(b), f"prompt {k}: {len(a)} tokens, the reference {len(b)}"
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is None:
            continue
        (first, *_), (second, *_) = r["meta_info"]["output_top_logprobs"][i][:2]
        assert first - second < FP32_TIE, (
            f"prompt {k} parts from the reference at token {i} ({a[i]} vs {b[i]}), where the "
            f"reference's top two logprobs differ by {first - second:.2e} (not a near tie)"
        )


def test_triton_matches_torch_in_fp32(make_engine):
    ref = greedy(make_engine, attention_backend="torch", dtype="float32")
    got = greedy(make_engine, attention_backend="triton", dtype="float32")
    assert_same_greedy(got, ref)


def test_cuda_graphs_change_nothing(make_engine):
    eager = greedy(make_engine, dtype="float32", disable_cuda_graph=True)
    graphed = greedy(make_engine, dtype="float32")
    assert_same_greedy(graphed, eager)
    # a batch size between two graph buckets (padding rows) and one above the largest graph
    many = [f"Item {i}: the colour of the sky is" for i in range(40)]
    assert_same_greedy(greedy(make_engine, many, dtype="float32", cuda_graph_max_bs=16),
                       greedy(make_engine, many, dtype="float32", disable_cuda_graph=True))  # fmt: skip


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


@pytest.fixture(scope="module")
def small_random(tmp_path_factory):
    """A random-weight Llama of the default model's vocabulary; its tokenizer from the folder in
    SGLBUS_GPU_TEST_MODEL when set (so this runs where the default model was not carried)."""
    import os

    from tiny_llama import tiny_llama

    from shared.model_files import resolve_model_folder, write_dummy_folder

    source = os.environ.get("SGLBUS_GPU_TEST_MODEL") or resolve_model_folder(None, need_weights=False)
    config = tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        max_position_embeddings=1024)  # fmt: skip
    return write_dummy_folder(str(tmp_path_factory.mktemp("small")), config, seed=5, tokenizer_from=source)


def test_short_extends_as_graph_rows_change_nothing(make_engine, small_random):
    """After a cache hit each prompt adds a few tokens: with CUDA graphs they run as one-token rows of
    a decode graph (StepInputs.as_rows), without as extends; the same greedy tokens."""
    outs, rows = {}, {}
    for graphs in (False, True):
        engine = make_engine(model_path=small_random, device="cuda", max_total_tokens=65536, dtype="float32",
                             disable_cuda_graph=not graphs)  # fmt: skip
        engine.generate(PROMPTS, [{**GREEDY, "max_new_tokens": 1}] * len(PROMPTS))  # the prompts cached
        more = [p + " Then, a few words later," for p in PROMPTS]  # one-token extends: a decode batch anyway
        outs[graphs] = engine.generate(more, [GREEDY] * len(more), return_logprob=True, top_logprobs_num=2)
        rows[graphs] = engine.get_stats()["row_steps"]
    assert rows[False] == 0 and rows[True] >= 1
    assert_same_greedy(outs[True], outs[False])
