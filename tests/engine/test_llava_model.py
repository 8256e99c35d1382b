"""LLaVA at the model level (the request path carries images later): a tiny random
`LlavaForConditionalGeneration` built from a transformers config (no download), saved, loaded by the
ModelRunner; one prefill with two images in the prompt gives transformers' logits in fp32, also when
the prompt is computed in two chunks that split an image, and from a checkpoint in the transformers 4
layout the published llava-hf folders use."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_families import IMAGE, build_llava, prefill_with_rows, save_folder

from services.scheduler.model_runner import ModelRunner
from shared.config import EngineConfig

TOKENS = 16  # (56 / 14) ** 2 patches, CLS dropped


@pytest.fixture(scope="module")
def llava(tmp_path_factory, model_folder):
    hf = build_llava()
    folder = save_folder(hf, str(tmp_path_factory.mktemp("llava")), model_folder)
    gen = torch.Generator().manual_seed(3)
    prompt = [5, 6, 7, *[IMAGE] * TOKENS, 8, 9, *[IMAGE] * TOKENS, 10, 11, 12]
    pixels = torch.randn(2, 3, 56, 56, generator=gen)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([prompt]), pixel_values=pixels).logits[0]
    return hf, folder, prompt, pixels, ref


def runner_of(folder: str) -> ModelRunner:
    cfg = EngineConfig(model_path=folder, dtype="float32", attention_backend="torch", device="cpu",
                       max_total_tokens=1024)  # fmt: skip
    return ModelRunner(cfg, folder)


def prefill(runner: ModelRunner, prompt: list[int], pixels: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of every prompt token, computed in chunks of these sizes (one request, row 0)."""
    rows = runner.model.image_features(pixels).reshape(-1, runner.model_config.hidden_size)
    return prefill_with_rows(runner, prompt, IMAGE, rows, chunks)


def test_images_in_the_prompt_give_transformers_logits(llava):
    hf, folder, prompt, pixels, ref = llava
    runner = runner_of(folder)
    assert runner.model.tokens_per_image == TOKENS
    torch.testing.assert_close(prefill(runner, prompt, pixels, [len(prompt)]), ref, atol=1e-4, rtol=1e-4)
    # without the images' rows the logits differ: the check above sees them
    assert not torch.allclose(prefill(runner_of(folder), [t if t != IMAGE else 0 for t in prompt], pixels,
                                      [len(prompt)]), ref, atol=1e-2)  # fmt: skip


def test_chunks_that_split_an_image(llava):
    hf, folder, prompt, pixels, ref = llava
    got = prefill(runner_of(folder), prompt, pixels, [10, 17, len(prompt) - 27])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_the_llava_hf_checkpoint_layout(llava, tmp_path):
    """transformers 4's names (`language_model.model.*`, `vision_tower.vision_model.*`, ...)."""
    from safetensors.torch import save_file

    hf, folder, prompt, pixels, ref = llava
    renames = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
               ("model.vision_tower.", "vision_tower.vision_model."),
               ("model.multi_modal_projector.", "multi_modal_projector."))  # fmt: skip
    tensors = {}
    for name, t in hf.state_dict().items():
        old, new = next((o, n) for o, n in renames if name.startswith(o))
        tensors[new + name[len(old) :]] = t.contiguous()
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(32)  # unused, still accepted
    tensors["vision_tower.vision_model.post_layernorm.bias"] = torch.zeros(32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as src, open(tmp_path / name, "wb") as dst:
                dst.write(src.read())
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlavaForConditionalGeneration"]
    got = prefill(runner_of(str(tmp_path)), prompt, pixels, [len(prompt)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
