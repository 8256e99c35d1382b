"""Tensor parallelism on CUDA (skipped with fewer than two GPUs): NCCL, the triton backend, CUDA
graphs that capture the all-reduces and the logits' all-gather. Two ranks give one rank's greedy tokens
in fp32 (parting only at a near tie) on a dense and a MoE family, and the default model in bf16 runs to
its lengths with no leaked slots."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)

from test_engine_gpu import assert_same_greedy  # noqa: E402
from test_families_gpu import PROMPTS, run, tokenizer_folder  # noqa: E402, F401 (tokenizer_folder: a fixture)
from tiny_families import FAMILIES, build_hf, save_folder  # noqa: E402


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_two_gpus_give_one_gpus_tokens(name, tmp_path, tokenizer_folder, make_engine):  # noqa: F811
    model_type, overrides = FAMILIES[name]
    folder = save_folder(build_hf(model_type, overrides), str(tmp_path / name), tokenizer_folder)
    ref = run(make_engine, folder, attention_backend="triton", dtype="float32")
    got = run(make_engine, folder, attention_backend="triton", dtype="float32", tp_size=2)
    assert_same_greedy(got, ref)


def test_default_model_bf16_on_two_gpus(make_engine):
    engine = make_engine(device="cuda", tp_size=2, max_total_tokens=8192)
    greedy = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[greedy] * len(PROMPTS))
    assert [len(o["output_ids"]) for o in outs] == [32] * len(PROMPTS)
