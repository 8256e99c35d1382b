"""LLaVA-NeXT (any resolution) through the Engine: pictures of different sizes and aspects, each tiled
and its rows packed by its own size, give transformers' greedy output in fp32 (one image, two of
different sizes in one prompt, a batch), and a repeated picture is a cache hit."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from tiny_families import NEW, PREPROCESSOR, redraw, save_folder

from shared.anyres import image_tokens
from shared.media import AnyResPreprocess

IMAGE = 49151
PINPOINTS = [[28, 56], [56, 28], [56, 56]]
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
PRE = {**PREPROCESSOR, "size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28},
       "image_grid_pinpoints": PINPOINTS, "image_processor_type": "LlavaNextImageProcessor"}  # fmt: skip


def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


WIDE, TALL, SQUARE = png(0, (20, 50)), png(1, (60, 24)), png(2, (40, 40))


def build_next():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(4)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=28, patch_size=7)  # fmt: skip
    text = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=800)  # fmt: skip
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                             image_grid_pinpoints=PINPOINTS)  # fmt: skip
    model = LlavaNextForConditionalGeneration(config).float().eval()
    return redraw(model)


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory, model_folder):
    hf = build_next()
    folder = save_folder(hf, str(tmp_path_factory.mktemp("llava-next")), model_folder)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(PRE, f)
    return hf, folder


def hf_greedy(hf, prompt: list[int], images: list[bytes]) -> list[int]:
    from PIL import Image

    pre = AnyResPreprocess(PRE, PINPOINTS)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    counts = iter([image_tokens(p.height, p.width, PINPOINTS, 28, 4) for p in pictures])
    ids = [t for x in prompt for t in ([IMAGE] * next(counts) if x == IMAGE else [x])]
    tiles = [torch.from_numpy(pre.pixels(p)) for p in pictures]
    most = max(t.shape[0] for t in tiles)  # the processor's batch: padded to the most tiles
    pixels = torch.stack([torch.cat([t, t.new_zeros(most - t.shape[0], *t.shape[1:])]) for t in tiles])
    sizes = torch.tensor([[p.height, p.width] for p in pictures])
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = hf.generate(x, pixel_values=pixels, image_sizes=sizes, attention_mask=torch.ones_like(x),
                        max_new_tokens=NEW, do_sample=False)  # fmt: skip
    return y[0, len(ids) :].tolist()


def test_pictures_of_any_size_equal_transformers(llava_next):
    from sglbus import Engine

    hf, folder = llava_next
    one, two = [5, 6, IMAGE, 7, 8], [5, IMAGE, 6, IMAGE, 7]
    refs = [hf_greedy(hf, one, [WIDE]), hf_greedy(hf, two, [TALL, SQUARE]), hf_greedy(hf, one, [SQUARE])]
    with Engine(model_path=folder, dtype="float32", chunked_prefill_size=32) as e:
        out = e.generate(input_ids=[one, two, one], image_data=[WIDE, [TALL, SQUARE], SQUARE],
                         sampling_params=GREEDY)  # fmt: skip
        assert [o["output_ids"] for o in out] == refs
        assert out[0]["meta_info"]["prompt_tokens"] == 4 + image_tokens(20, 50, PINPOINTS, 28, 4)
        again = e.generate(input_ids=one, image_data=WIDE, sampling_params=GREEDY)
        assert again["output_ids"] == refs[0] and again["meta_info"]["cached_tokens"] >= 2 + 20
        e.check_integrity()
