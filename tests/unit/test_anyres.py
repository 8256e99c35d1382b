"""LLaVA-NeXT any-resolution preprocessing (shared/media.py `AnyResPreprocess`): the tiles, their order,
the pinpoint chosen and the grid shape equal transformers' LlavaNextImageProcessor (its PIL backend) on
LLaVA-NeXT's config and small ones, over landscape, portrait, tiny, square and oversized images."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from tiny_families import LLAVA_15_PREPROCESSOR

from shared.media import ANYRES_PINPOINTS, AnyResPreprocess

# llava-hf/llava-v1.6-mistral-7b-hf's preprocessor_config.json: LLaVA-1.5's with its pinpoints
NEXT = {**LLAVA_15_PREPROCESSOR, "image_grid_pinpoints": [list(p) for p in ANYRES_PINPOINTS]}
SMALL = {**NEXT, "crop_size": {"height": 28, "width": 28}, "size": {"shortest_edge": 28}}
SMALL_PINPOINTS = [[28, 56], [56, 28], [56, 56]]
# the per-tile CLIP resize and crop doing work: tiles cut at 28, resized to 32, cropped back to 28
RESIZED = {**SMALL, "size": {"shortest_edge": 32}, "resample": 2}
# pinpoints that 28 does not divide: the grid's last row and column are partial tiles
UNEVEN = [[42, 70], [70, 42], [28, 28]]
# (width, height): landscape, portrait, tiny, square, extreme strips, larger than every pinpoint
NEXT_SIZES = [(500, 300), (257, 700), (7, 5), (1400, 1100)]
SMALL_SIZES = [(90, 40), (33, 77), (3, 2), (60, 60), (1, 1), (200, 3), (2, 150), (150, 130), (56, 28)]


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """Noise: every pixel differs from its neighbours, so any shift, flip or filter change shows."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def next_pil():
    """transformers' slow LLaVA-NeXT processor: LlavaNextImageProcessorPil in transformers 5, where the
    default LlavaNextImageProcessor is the torchvision one; LlavaNextImageProcessor itself in 4."""
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, "LlavaNextImageProcessorPil", None) or transformers.LlavaNextImageProcessor


CASES = [
    (NEXT, None, NEXT_SIZES),
    (SMALL, SMALL_PINPOINTS, SMALL_SIZES),
    (RESIZED, SMALL_PINPOINTS, SMALL_SIZES[:5]),
    (SMALL, UNEVEN, SMALL_SIZES[:5]),
]


@pytest.mark.parametrize(("config", "pinpoints", "sizes"), CASES, ids=["next", "small", "resized", "uneven"])
def test_tiles_equal_transformers(next_pil, config: dict, pinpoints: list | None, sizes: list) -> None:
    """One batch, so transformers pads to the most tiles: ours are its real tiles, the rest is zeros."""
    processor = next_pil(**{**config, "image_grid_pinpoints": pinpoints or config["image_grid_pinpoints"]})
    ours = AnyResPreprocess(config, pinpoints)
    images = [picture(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    expected = processor(images=images, return_tensors="np")
    counts = set()
    for image, batch, size in zip(images, expected["pixel_values"], expected["image_sizes"], strict=True):
        assert tuple(size) == (image.height, image.width)
        tiles = ours.tiles(image)
        count, crop = ours.num_tiles(image.height, image.width), config["crop_size"]["height"]
        assert tiles.dtype == np.uint8 and tiles.shape == (count, crop, crop, 3), image.size
        if pinpoints is not UNEVEN:  # else the partial row/column is a tile the grid shape floors away
            rows, cols = ours.grid_shape(image.height, image.width)
            assert count == 1 + rows * cols
        got = ours.normalize(tiles)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, batch[:count], rtol=0, atol=1e-5, err_msg=str(image.size))
        assert not batch[count:].any()  # do_pad's filler
        np.testing.assert_array_equal(ours.pixels(image), got)
        counts.add(count)
    assert len(counts) > 1  # the batch mixed tile counts, so the padding was exercised


def test_rgba_is_composited_as_transformers(next_pil) -> None:
    rgba = np.asarray(picture(45, 20, 3).convert("RGBA")).copy()
    rgba[..., 3] = np.arange(45, dtype=np.uint8)[None, :] * 5
    image = Image.fromarray(rgba, "RGBA")
    processor = next_pil(**{**SMALL, "image_grid_pinpoints": SMALL_PINPOINTS})
    expected = processor(images=image, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(AnyResPreprocess(SMALL, SMALL_PINPOINTS).pixels(image), expected, atol=1e-5)


@pytest.mark.parametrize("pinpoints", [list(ANYRES_PINPOINTS), SMALL_PINPOINTS, UNEVEN])
def test_best_resolution_and_grid_equal_transformers(pinpoints: list) -> None:
    pytest.importorskip("torch")
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

    ours = AnyResPreprocess(SMALL, pinpoints)
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 1500, (300, 2))]
    sizes += [(p[0] * k, p[1] * k) for p in pinpoints for k in (1, 2)] + [(1, 1), (1, 5000), (5000, 1)]
    for height, width in sizes:
        best = select_best_resolution((height, width), pinpoints)
        assert ours.best_resolution(height, width) == tuple(best), (height, width)
        grid = get_anyres_image_grid_shape((height, width), pinpoints, 28)
        assert ours.grid_shape(height, width) == tuple(grid), (height, width)


def test_config_choices() -> None:
    assert AnyResPreprocess(NEXT).pinpoints == ANYRES_PINPOINTS  # from the processor config
    assert AnyResPreprocess(NEXT, [[28, 56]]).pinpoints == ((28, 56),)  # the argument's, not the config's
    assert AnyResPreprocess({**NEXT, "image_grid_pinpoints": None}).pinpoints == ANYRES_PINPOINTS
    assert AnyResPreprocess(NEXT).best_resolution(300, 500) == (336, 672)
    assert AnyResPreprocess(NEXT).grid_shape(700, 257) == (3, 1)  # 1008x336: the most pixels kept
    assert AnyResPreprocess(NEXT).num_tiles(700, 257) == 4
    assert AnyResPreprocess(SMALL, UNEVEN).grid_shape(40, 90) == (1, 2)  # 42x70 floored by 28
    assert AnyResPreprocess(SMALL, UNEVEN).num_tiles(40, 90) == 7  # but cut into 2x3 tiles
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        AnyResPreprocess(SMALL, [[0, 28]])
