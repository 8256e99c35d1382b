"""The triton backend and Triton ops on the families' own parts, end to end on tiny random models (on
CPU through Triton's interpreter): sliding windows shorter than the prompts (Mistral), windows,
soft-caps, q/k norms and GeGLU together (Gemma 2 / 3), and the fused MoE kernel (Qwen3-MoE) give the
torch reference's greedy tokens, through chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tiny_families import FAMILIES, build_hf, save_folder  # noqa: E402

PROMPTS = [list(range(100, 130)), list(range(100, 120)) + [7, 8, 9], [5, 6, 7]]
PARAMS = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
SMALL = {"num_hidden_layers": 2}  # the interpreter is slow: two layers (one sliding, one global)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3", "qwen3_moe"])
def test_triton_matches_torch(name, tmp_path, model_folder, make_engine):
    model_type, overrides = FAMILIES[name]
    hf = build_hf(model_type, {**overrides, **SMALL})
    folder = save_folder(hf, str(tmp_path / name), model_folder)
    outs = {}
    for backend in ("torch", "triton"):
        options = {"attention_backend": backend, "dtype": "float32", "chunked_prefill_size": 16}
        engine = make_engine(model_path=folder, device="cpu", **options)
        first = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS)  # fills the cache
        rest = engine.generate(input_ids=PROMPTS[1:], sampling_params=[PARAMS] * 2)
        outs[backend] = [o["output_ids"] for o in (first, *rest)]
        assert rest[0]["meta_info"]["cached_tokens"] == 20  # the shared prefix came from the cache
    assert outs["triton"] == outs["torch"]
