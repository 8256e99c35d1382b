"""Every family on CUDA (skipped without a GPU): tiny random models built from transformers configs
(tests/tiny_families.py) run on the triton backend with CUDA graphs (the fused MoE kernel for the
MoE families) and give the torch backend's greedy tokens in fp32 (parting only at a near tie, as in
test_engine_gpu.py); bf16 runs end with the right lengths and no leaked slots.

The tokenizer comes from the default model, or from `SGLBUS_TEST_TOKENIZER` (a folder with
tokenizer.json) on a machine without it."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_engine_gpu import assert_same_greedy  # noqa: E402
from tiny_families import FAMILIES, build_hf, save_folder  # noqa: E402

PROMPTS = [list(range(100, 140)), list(range(100, 130)) + [7, 8, 9], [5, 6, 7], list(range(2000, 2070))]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer_folder():
    folder = os.environ.get("SGLBUS_TEST_TOKENIZER")
    if folder:
        return folder
    from shared.model_files import resolve_model_folder

    try:
        return resolve_model_folder(None)
    except Exception as e:  # noqa: BLE001 - the default model is not on this machine
        pytest.skip(f"no tokenizer: set SGLBUS_TEST_TOKENIZER ({e})")


def run(make_engine, folder, **options):
    engine = make_engine(model_path=folder, device="cuda", max_total_tokens=8192, **options)
    logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    first = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, **logprobs)  # fills the cache
    return [first, *engine.generate(input_ids=PROMPTS[1:], sampling_params=[GREEDY] * 3, **logprobs)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_triton_and_graphs_give_the_torch_tokens(name, tmp_path, tokenizer_folder, make_engine):
    model_type, overrides = FAMILIES[name]
    folder = save_folder(build_hf(model_type, overrides), str(tmp_path / name), tokenizer_folder)
    ref = run(make_engine, folder, attention_backend="torch", dtype="float32", disable_cuda_graph=True)
    got = run(make_engine, folder, attention_backend="triton", dtype="float32", chunked_prefill_size=16)
    assert_same_greedy(got, ref)
    half = run(make_engine, folder, attention_backend="triton", dtype="bfloat16")
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in half)
