"""sgl.image / sgl.video on the offline Engine with the tiny LLaVA: a program gives the text that
`engine.generate(text=..., image_data=[...])` gives for the same prompt (and transformers' tokens); forks,
select and a video of frames carry their images (the gateway refuses an image token without its image,
so a request that lost them would fail).

The tiny LLaVA's folder gets the default model's tokenizer (SmolLM2's, 49152 tokens), which has no
`<image>`; its image token id 49151 is the BPE token "ectable" there. The fixture re-purposes that id:
"ectable" leaves the vocabulary (with the one merge that made it) and `<image>` takes id 49151 as an
added special token. (Adding `<image>` beside it is not enough: the tokenizers library gives an added
token whose id the vocabulary already uses the next free id, 49152, out of the model's range.)"""

from __future__ import annotations

import io

import numpy as np
import pytest
from tiny_families import (
    IMAGE,
    give_image_token,
    llava_folder,
    llava_greedy,
)

import sglbus as sgl
from sglbus.lang.backends.base import resolve_backend

TOKENS = 16  # slots per image of the tiny tower
NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW}


def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


CAT, DOG = png(0, (80, 64)), png(1, (56, 90))


@pytest.fixture(scope="module")
def llava(tmp_path_factory, model_folder):
    hf, folder = llava_folder(tmp_path_factory, model_folder, "llava-lang")
    give_image_token(folder)
    return hf, folder


@pytest.fixture(scope="module")
def engine(llava):
    with sgl.Engine(model_path=llava[1], dtype="float32") as e:
        yield e
        e.check_integrity()


def test_the_fixture_maps_the_image_token_text_to_its_id(engine):
    ids = engine.tokenizer("Describe <image> briefly:", add_special_tokens=False)["input_ids"]
    assert ids.count(IMAGE) == 1
    assert engine.requests.images.image_token == "<image>"
    backend = resolve_backend(engine)  # the EngineBackend that runs programs on it
    assert backend.get_model_info()["has_image_understanding"] and backend.image_token() == "<image>"


@sgl.function
def describe(s, picture):
    s += "Describe " + sgl.image(picture) + " briefly:"
    s += sgl.gen("d", max_tokens=NEW, temperature=0)


def test_a_program_with_an_image_gives_engine_generates_text_and_transformers_tokens(engine, llava):
    state = describe.run(picture=CAT, backend=engine)
    assert state.error() is None, state.error()
    prompt = "Describe <image> briefly:"
    direct = engine.generate(text=prompt, image_data=[CAT], sampling_params=GREEDY)
    assert state["d"] == direct["text"] and len(direct["output_ids"]) == NEW
    assert state.text() == prompt + direct["text"]
    assert direct["meta_info"]["prompt_tokens"] == len(engine.tokenizer(prompt)["input_ids"]) - 1 + TOKENS
    ids = engine.tokenizer(prompt)["input_ids"]
    out = direct["output_ids"]
    assert llava_greedy(llava[0], ids, [CAT])[: len(out)] == out
    other = describe.run(picture=DOG, backend=engine)  # another image: the engine's answer for it
    assert other["d"] == engine.generate(text=prompt, image_data=[DOG], sampling_params=GREEDY)["text"]


def test_forks_and_select_carry_the_image_of_their_prefix(engine):
    @sgl.function
    def branches(s, picture):
        s += "Look: " + sgl.image(picture) + "\n"
        forks = s.fork(2)
        for f, q in zip(forks, ["Color?", "Size?"], strict=True):
            f += q + sgl.gen("a", max_tokens=4, temperature=0)
        forks.join()
        s += "Pick:" + sgl.select("pick", choices=[" red", " big"])

    state = branches.run(picture=CAT, backend=engine)
    assert state.error() is None, state.error()
    for q, got in zip(["Color?", "Size?"], state["a"], strict=True):
        want = engine.generate(text=f"Look: <image>\n{q}", image_data=[CAT],
                               sampling_params={"temperature": 0, "max_new_tokens": 4})["text"]  # fmt: skip
        assert got == want
    assert state["pick"] in (" red", " big")


def test_a_video_of_frames_is_its_frames_as_images(engine):
    @sgl.function
    def clip(s, frames):
        s += "Clip: " + sgl.video(frames, 2) + " what changes?"
        s += sgl.gen("d", max_tokens=NEW, temperature=0)

    state = clip.run(frames=[CAT, DOG], backend=engine)
    assert state.error() is None, state.error()
    direct = engine.generate(
        text="Clip: <image><image> what changes?", image_data=[CAT, DOG], sampling_params=GREEDY
    )
    assert state["d"] == direct["text"]
