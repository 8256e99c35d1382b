"""LLaVA-NeXT at the model level against transformers in fp32: a tiny random
`LlavaNextForConditionalGeneration` (no download), saved and loaded; pictures of several sizes tiled by
transformers' own (PIL) image processor give transformers' packed features, as many rows as its
processor puts `<image>` tokens in the prompt, and, put at those tokens, transformers' logits.

The CLIP tower cuts its 28x28 tiles into 7x7 patches (a 4x4 map a tile, not the brief's 14: with 2x2 the
unpadding seldom cuts anything), so the wide and tall pictures below lose rows or columns to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_families import prefill_with_rows, redraw, save_folder
from transformers import (
    AutoTokenizer,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
)

from services.scheduler.model_runner import ModelRunner
from services.scheduler.models import model_class
from shared.anyres import select_best_resolution, unpad_margins
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.model_files import iter_weight_slices

IMAGE = 999  # the image token
PINPOINTS = [[28, 56], [56, 28], [56, 56]]
PATCH = 7
# (height, width): wide, tall, square, the tile's own size, and thin ones whose padding is cut away
SIZES = [(20, 50), (50, 20), (60, 60), (28, 28), (10, 60), (60, 10), (10, 80), (37, 23)]


def build_hf(seed: int = 0, **overrides) -> LlavaNextForConditionalGeneration:
    """transformers' model, fp32, every weight drawn larger than its init (std 0.08; norms ~1)."""
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=28, patch_size=PATCH)  # fmt: skip
    text = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                             image_grid_pinpoints=PINPOINTS, **overrides)  # fmt: skip
    model = LlavaNextForConditionalGeneration(config).float().eval()
    return redraw(model)


@pytest.fixture(scope="module")
def hf() -> LlavaNextForConditionalGeneration:
    return build_hf()


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory, model_folder) -> str:
    return save_folder(hf, str(tmp_path_factory.mktemp("llava_next")), model_folder)


@pytest.fixture(scope="module")
def ours(folder):
    config = ModelConfig.from_folder(folder)
    model = model_class(config)(config, 512, torch.float32)
    model.load_weights(iter_weight_slices(folder))
    return model.eval()


@pytest.fixture(scope="module")
def processor(model_folder) -> LlavaNextProcessor:
    """transformers' processor as llava-hf ships it (num_additional_image_tokens 1: CLIP's CLS), at our
    tile size, with the default model's tokenizer taught `<image>`."""
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=PINPOINTS)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                              vision_feature_select_strategy="default",
                              num_additional_image_tokens=1)  # fmt: skip


def picture(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed + 1000 * height + width)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_features(hf, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> list[torch.Tensor]:
    """transformers' packed rows of each picture (get_image_features packs them: `pooler_output`)."""
    with torch.inference_mode():
        return list(hf.model.get_image_features(pixel_values, image_sizes).pooler_output)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_features_and_token_count(hf, ours, processor, size):
    height, width = size
    inputs = processor(images=picture(height, width), text="a <image> b", return_tensors="pt")
    tiles = inputs["pixel_values"][0]  # one picture: no padding tiles
    assert inputs["image_sizes"][0].tolist() == [height, width]
    assert ours.num_tiles(height, width) == tiles.shape[0] == 1 + np.prod(ours.grid_shape(height, width))
    got = ours.image_features(tiles, (height, width))
    ref = hf_features(hf, inputs["pixel_values"], inputs["image_sizes"])[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    placeholders = int((inputs["input_ids"][0] == processor.image_token_id).sum())
    assert ours.num_image_tokens(height, width) == got.shape[0] == placeholders


def test_the_grid_tiles_order_matters(ours, processor):
    """The check above would see tiles taken in another order (base first, then row by row)."""
    inputs = processor(images=picture(60, 60), text="<image>", return_tensors="pt")
    tiles = inputs["pixel_values"][0]
    right = ours.image_features(tiles, (60, 60))
    swapped = ours.image_features(tiles[[0, 2, 1, 3, 4]], (60, 60))  # columns of the first row swapped
    assert not torch.allclose(right, swapped, atol=1e-3)
    with pytest.raises(ValueError, match="takes 5 tiles"):
        ours.image_features(tiles[:4], (60, 60))


def test_padding_tiles_of_a_batch_are_dropped(hf, ours, processor):
    """The processor pads a batch's pictures to its largest one's tile count; those tiles are ignored."""
    inputs = processor(images=[picture(20, 50), picture(60, 60)], text="<image><image>", return_tensors="pt")
    assert inputs["pixel_values"].shape[:2] == (2, 5)
    ref = hf_features(hf, inputs["pixel_values"], inputs["image_sizes"])
    for tiles, size, want in zip(inputs["pixel_values"], inputs["image_sizes"].tolist(), ref, strict=True):
        torch.testing.assert_close(ours.image_features(tiles, size), want, atol=1e-5, rtol=1e-5)


def test_helpers_against_transformers():
    """Best resolution and unpadding as transformers computes them: many sizes, the default pinpoints."""
    from transformers.image_processing_utils import select_best_resolution as hf_best
    from transformers.models.llava_next.modeling_llava_next import unpad_image

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    rng = np.random.default_rng(0)
    for height, width in rng.integers(1, 2000, (300, 2)).tolist():
        best = select_best_resolution(height, width, pinpoints)
        assert best == tuple(hf_best((height, width), pinpoints))
        rows, cols = best[0] // 14, best[1] // 14
        cut_rows, cut_cols = unpad_margins(height, width, rows, cols)
        kept = unpad_image(torch.zeros(1, rows, cols), (height, width)).shape[1:]
        assert (rows - 2 * cut_rows, cols - 2 * cut_cols) == tuple(kept)


def runner_of(folder: str) -> ModelRunner:
    cfg = EngineConfig(model_path=folder, dtype="float32", attention_backend="torch", device="cpu",
                       max_total_tokens=1024)  # fmt: skip
    return ModelRunner(cfg, folder)


def prefill(runner: ModelRunner, prompt: list[int], rows: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    return prefill_with_rows(runner, prompt, IMAGE, rows, chunks)


def test_two_pictures_in_the_prompt_give_transformers_logits(hf, folder, processor):
    sizes = [(20, 50), (60, 10)]
    inputs = processor.image_processor([picture(*s) for s in sizes], return_tensors="pt")
    runner = runner_of(folder)
    assert type(runner.model).__name__ == "LlavaNextLlama"
    counts = [runner.model.num_image_tokens(*s) for s in sizes]
    prompt = [5, 6, 7, *[IMAGE] * counts[0], 8, 9, *[IMAGE] * counts[1], 10, 11, 12]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([prompt]), pixel_values=inputs["pixel_values"],
                 image_sizes=inputs["image_sizes"]).logits[0]  # fmt: skip
    rows = torch.cat(
        [runner.model.image_features(t, s) for t, s in zip(inputs["pixel_values"], sizes, strict=True)]
    )
    torch.testing.assert_close(prefill(runner, prompt, rows, [len(prompt)]), ref, atol=1e-4, rtol=1e-4)
    split = [20, 40, len(prompt) - 60]  # chunks that end inside each picture
    torch.testing.assert_close(prefill(runner_of(folder), prompt, rows, split), ref, atol=1e-4, rtol=1e-4)


def test_the_llava_hf_checkpoint_layout(hf, ours, folder, processor):
    """transformers 4's names (top-level `image_newline`, `language_model.model.*`, ...)."""
    renames = (("model.image_newline", "image_newline"), ("model.language_model.", "language_model.model."),
               ("lm_head.", "language_model.lm_head."), ("model.vision_tower.", "vision_tower.vision_model."),
               ("model.multi_modal_projector.", "multi_modal_projector."))  # fmt: skip
    tensors = {}
    for name, t in hf.state_dict().items():
        old, new = next((o, n) for o, n in renames if name.startswith(o))
        tensors[new + name[len(old) :]] = t
    config = ModelConfig.from_folder(folder)
    model = model_class(config)(config, 512, torch.float32)
    model.load_weights(tensors.items())
    assert torch.equal(model.image_newline, hf.model.image_newline)
    tiles = processor(images=picture(50, 20), text="<image>", return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(model.image_features(tiles, (50, 20)), ours.image_features(tiles, (50, 20)))


def test_full_select_strategy_is_refused_as_transformers_cannot_pack_it(processor):
    """Strategy "full" keeps CLIP's CLS row, so a tile's h*w + 1 rows have no h x w map: transformers' own
    packing fails on it; we refuse such a config when the model is built."""
    hf = build_hf(vision_feature_select_strategy="full")
    inputs = processor(images=picture(60, 60), text="<image>", return_tensors="pt")
    with pytest.raises(RuntimeError):
        hf_features(hf, inputs["pixel_values"], inputs["image_sizes"])
    config = ModelConfig.from_dict(
        {**hf.config.to_dict(), "architectures": ["LlavaNextForConditionalGeneration"]}
    )
    with pytest.raises(ValueError, match="'full' is not supported"):
        model_class(config)(config, 512, torch.float32)
