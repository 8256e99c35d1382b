"""The gateway's side of image inputs (services/gateway/image_inputs.py), on a tiny LLaVA folder that
holds only its config.json and preprocessor_config.json: image tokens expanded into placeholders that
tell images apart, one `ImageInput` per image at its offset, and every refusal a ValueError (a 400)
that names image_data; `image_data` parsed per prompt as SGLang reads it; the request manager puts the
images on every message of a request, n > 1 included."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from services.gateway.generate_input import parse_generate_input
from services.gateway.image_inputs import ImageInputs
from services.gateway.request_manager import RequestManager
from shared.media import ClipPreprocess, MediaLimits, image_hash
from shared.messages import Decoder, GenerateReq
from shared.transport import InProcessTransport

VOCAB = 49152
IMAGE = 49151  # the image token
TOKENS = 16  # (56 // 14) ** 2
PREPROCESSOR = {"size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 56}}


def png(seed: int, size: tuple[int, int] = (40, 70)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


CAT, DOG = png(0), png(1)


def write_llava(folder: str, preprocessor: dict | None = PREPROCESSOR) -> str:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(image_size=56, patch_size=14, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                         architectures=["LlavaForConditionalGeneration"])  # fmt: skip
    config.save_pretrained(folder)
    if preprocessor is not None:
        with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
            json.dump(preprocessor, f)
    return folder


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return write_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def images(llava) -> ImageInputs:
    inputs = ImageInputs.from_folder(llava, VOCAB, MediaLimits())
    assert inputs is not None
    return inputs


def placeholder(data: bytes) -> int:
    """The value of each slot of this image: vocab_size + the hash of its preprocessed tiles (one)."""
    pixels = ClipPreprocess(PREPROCESSOR).uint8(Image.open(io.BytesIO(data)).convert("RGB"))
    return VOCAB + image_hash(pixels[None]) % (1 << 30)


def test_the_folder_gives_the_image_token_and_its_slots(images):
    assert (images.image_token_id, images.tokens_per_image) == (IMAGE, TOKENS)
    assert images.image_token == "<image>"


def test_one_image_becomes_its_placeholders_at_its_offset(images):
    ids, (im,) = images.expand([5, 6, IMAGE, 7], CAT)
    assert ids == [5, 6, *[placeholder(CAT)] * TOKENS, 7]
    assert (im.offset, im.length, im.height, im.width) == (2, TOKENS, 56, 56)
    expected = ClipPreprocess(PREPROCESSOR).uint8(Image.open(io.BytesIO(CAT)).convert("RGB"))
    assert im.pixels == expected.tobytes() and im.hash == image_hash(expected[None])


def test_two_images_are_told_apart_and_the_same_image_is_the_same_whatever_its_form(images):
    ids, (cat, dog) = images.expand([1, IMAGE, 2, IMAGE, 3], [CAT, DOG])
    assert (cat.offset, dog.offset) == (1, 2 + TOKENS)
    assert ids == [1, *[placeholder(CAT)] * TOKENS, 2, *[placeholder(DOG)] * TOKENS, 3]
    assert placeholder(CAT) != placeholder(DOG)
    url = "data:image/png;base64," + base64.b64encode(CAT).decode()
    again, (same, _) = images.expand([1, IMAGE, 2, IMAGE, 3], [url, base64.b64encode(CAT).decode()])
    assert again[: 1 + TOKENS] == ids[: 1 + TOKENS] and same.hash == cat.hash


def test_images_and_image_tokens_must_match_in_number(images):
    with pytest.raises(ValueError) as caught:
        images.expand([1, IMAGE, 2], [CAT, DOG])
    assert str(caught.value) == (
        f"image_data has 2 images but the prompt has 1 image token (<image>, id {IMAGE}): put one where "
        "each image goes"
    )
    with pytest.raises(ValueError, match=r"^image_data\[1\] has 1 image but the prompt has 0 image tokens"):
        images.expand([1, 2], CAT, "image_data[1]")


def test_a_url_is_refused_naming_the_field(images):
    with pytest.raises(ValueError, match=r"^image_data\[0\]: URLs are not fetched"):
        images.expand([IMAGE], ["https://example.com/cat.png"])


def test_a_text_model_takes_no_images(model_folder):
    assert ImageInputs.from_folder(model_folder, VOCAB, MediaLimits()) is None
    rm = RequestManager(None, InProcessTransport(), "sglbus", VOCAB)
    with pytest.raises(ValueError, match=r"^image_data: this model \(a text model.*\) takes no images"):
        asyncio.run(rm.submit(parse_generate_input({"input_ids": [1, 2], "image_data": "aGk="})))
    rm._pool.shutdown(wait=True)


def test_a_processor_that_does_not_give_the_towers_size_is_refused_at_start(tmp_path):
    folder = write_llava(str(tmp_path), {**PREPROCESSOR, "crop_size": 48})
    with pytest.raises(ValueError, match="gives 48x48 images; the vision tower takes 56x56"):
        ImageInputs.from_folder(folder, VOCAB, MediaLimits())


def test_the_server_says_it_understands_images(llava, images):
    from services.gateway.config import GatewayConfig
    from services.gateway.service import Gateway
    from shared.model_config import ModelConfig

    model = ModelConfig.from_folder(llava)
    gateway = Gateway(GatewayConfig(), InProcessTransport(), None, model, llava, llava, images)
    assert gateway.model_info()["has_image_understanding"] is True


class WorkBus(InProcessTransport):
    """Records the requests published to the schedulers' work queue."""

    def __init__(self) -> None:
        super().__init__()
        self.work: list[GenerateReq] = []
        self._dec = Decoder(GenerateReq)

    async def publish_work(self, subject: str, data: bytes, key: str | None = None) -> int:
        self.work.append(self._dec(data))
        return 0


@pytest.fixture
def rm(images) -> Iterator[RequestManager]:
    requests = RequestManager(None, WorkBus(), "sglbus", VOCAB, context_len=40, images=images)
    yield requests
    requests._pool.shutdown(wait=True)


def submit(rm: RequestManager, **body) -> list[GenerateReq]:
    """The messages this request went to the schedulers as."""
    work = rm.transport.work  # type: ignore[attr-defined]
    before = len(work)
    asyncio.run(rm.submit(parse_generate_input(body)))
    return work[before:]


def test_every_request_of_n_samples_carries_the_images(rm):
    (msg,) = submit(rm, input_ids=[1, IMAGE, 2], image_data=CAT, sampling_params={"n": 2})
    assert len(msg.then) == 2  # the prefill, then the two samples
    for req in (msg, *msg.then):
        assert req.input_ids == [1, *[placeholder(CAT)] * TOKENS, 2]
        assert [(im.offset, im.hash) for im in req.images] == [(1, msg.images[0].hash)]


def test_a_batch_gives_each_prompt_its_own_images(rm):
    batch = [[IMAGE, 1], [IMAGE, IMAGE], [3]]
    one, two, none = submit(rm, input_ids=batch, image_data=[CAT, [DOG, CAT], None])
    assert [im.hash for im in one.images] == [two.images[1].hash]
    assert [im.offset for im in two.images] == [0, TOKENS] and not none.images


def test_a_prompt_with_the_image_token_and_no_image_is_refused(rm):
    with pytest.raises(ValueError, match=r"^image_data has 0 images but the prompt has 1 image token"):
        submit(rm, input_ids=[1, IMAGE])


def test_the_expanded_prompt_must_fit_the_context(rm):
    assert submit(rm, input_ids=[1, IMAGE, 2], image_data=CAT, sampling_params={"max_new_tokens": 22})
    with pytest.raises(ValueError, match="You requested a total of 41 tokens: 18 tokens from the input"):
        submit(rm, input_ids=[1, IMAGE, 2], image_data=CAT, sampling_params={"max_new_tokens": 23})
    with pytest.raises(ValueError, match="the prompt has 41 tokens; at most 39 fit"):
        submit(rm, input_ids=[*range(1, 25), IMAGE, 2], image_data=CAT)


def test_prompt_logprobs_start_after_the_last_image(rm):
    ask = {"input_ids": [1, IMAGE, 2, 3], "image_data": CAT, "return_logprob": True}
    with pytest.raises(ValueError) as caught:
        submit(rm, **ask, logprob_start_len=0)
    assert "set logprob_start_len to at least 17, or -1 for output logprobs only" in str(caught.value)
    assert len(submit(rm, **ask, logprob_start_len=17)) == 1
    assert len(submit(rm, **ask)) == 1  # the default, -1: output logprobs only


def prompts_images(**body) -> list:
    return [p.images for p in parse_generate_input(body).prompts]


def test_image_data_is_read_per_prompt_as_sglang_reads_it():
    assert prompts_images(text="a", image_data="x") == ["x"]
    assert prompts_images(text="a", image_data=["x", "y"]) == [["x", "y"]]
    assert prompts_images(text="a", image_data=[]) == [None]
    assert prompts_images(text="a") == [None]
    assert prompts_images(text=["a", "b"], image_data=["x", "y"]) == ["x", "y"]  # one image each
    assert prompts_images(text=["a", "b", "c"], image_data=[None, "x", ["y", "z"]]) == [None, "x", ["y", "z"]]
    assert prompts_images(text=["a", "b"], image_data="x") == ["x", "x"]  # one image for every prompt
    assert prompts_images(input_ids=[[1], [2]], image_data=[[], "x"]) == [None, "x"]


BAD_SHAPES = {
    "short_batch": ({"text": ["a", "b"], "image_data": ["x"]}, "image_data is a list of 1 for 2 prompts"),
    "batch_dict": ({"text": ["a", "b"], "image_data": {"x": 1}}, "image_data is of type dict for 2 prompts"),
    "number": ({"text": "a", "image_data": 5}, "image_data must be an image (base64, a data URL or a file "
               "path) or a list of images, not int"),
    "null_item": ({"text": "a", "image_data": ["x", None]}, "image_data[1] must be an image (base64, a data "
                  "URL or a file path), not null"),
    "batch_item": ({"text": ["a", "b"], "image_data": ["x", [1]]}, "image_data[1][0] must be an image"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_SHAPES)
def test_image_data_of_the_wrong_shape_is_refused_naming_it(case):
    body, words = BAD_SHAPES[case]
    with pytest.raises(ValueError) as caught:
        parse_generate_input(body)
    assert words in str(caught.value)
