"""LLaVA through the Engine (the same request path as the server's `/generate`): images as PNG bytes,
base64 and data URLs in `image_data`; greedy output equal to transformers' `generate` in fp32 for one
and two images, as a batch, and after a cache hit (a repeated image and prompt: `cached_tokens` covers
the image's placeholders; another image never matches them); a bad image is a 400 that hurts no other
request; two tensor-parallel ranks give the same tokens."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from tiny_families import (
    IMAGE,
    NEW,
    give_image_token,
    llava_folder,
    llava_greedy,
)

GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
TOKENS = 16


def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def llava(tmp_path_factory, model_folder):
    hf, folder = llava_folder(tmp_path_factory, model_folder, "llava-engine")
    return hf, folder


CAT, DOG = png(0, (80, 64)), png(1, (56, 90))
ONE = [5, 6, 7, IMAGE, 8, 9]
TWO = [5, IMAGE, 6, 7, IMAGE, 8]


@pytest.fixture(scope="module")
def refs(llava):
    hf, _ = llava
    return {
        "one": llava_greedy(hf, ONE, [CAT]),
        "two": llava_greedy(hf, TWO, [CAT, DOG]),
        "dog": llava_greedy(hf, ONE, [DOG]),
    }


@pytest.fixture(scope="module")
def engine(llava):
    from sglbus import Engine

    with Engine(model_path=llava[1], dtype="float32", chunked_prefill_size=12) as e:
        yield e
        e.check_integrity()


def test_one_and_two_images_equal_transformers(engine, refs):
    b64 = base64.b64encode(CAT).decode()
    out = engine.generate(input_ids=ONE, image_data=b64, sampling_params=GREEDY)
    assert out["output_ids"] == refs["one"]
    assert out["meta_info"]["prompt_tokens"] == len(ONE) - 1 + TOKENS
    url = "data:image/png;base64," + base64.b64encode(DOG).decode()
    two = engine.generate(input_ids=TWO, image_data=[CAT, url], sampling_params=GREEDY)
    assert two["output_ids"] == refs["two"]
    batch = engine.generate(
        input_ids=[ONE, TWO, ONE], image_data=[CAT, [CAT, DOG], DOG], sampling_params=GREEDY
    )
    assert [o["output_ids"] for o in batch] == [refs["one"], refs["two"], refs["dog"]]


def test_a_repeated_image_hits_the_cache_and_another_does_not(engine, refs):
    prompt = [30, 31, 32, IMAGE, 10, 11]  # a text no other test sends
    first = engine.generate(input_ids=prompt, image_data=CAT, sampling_params=GREEDY)
    again = engine.generate(input_ids=prompt, image_data=CAT, sampling_params=GREEDY)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 3 + TOKENS  # the image's placeholders too
    other = engine.generate(input_ids=prompt, image_data=DOG, sampling_params=GREEDY)
    assert other["meta_info"]["cached_tokens"] <= 3  # the text before the image only


def test_bad_images_are_refused_and_others_complete(engine, refs):
    for bad, words in [(CAT[:200], "truncated"), (b"not an image at all", "not an image"),
                       ("https://example.com/cat.png", "not fetched")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            engine.generate(input_ids=ONE, image_data=bad, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="image_data"):
        engine.generate(input_ids=ONE, image_data=[CAT, DOG], sampling_params=GREEDY)  # 2 images, 1 token
    assert engine.generate(input_ids=ONE, image_data=CAT, sampling_params=GREEDY)["output_ids"] == refs["one"]


@pytest.mark.slow
def test_two_ranks_give_the_same_tokens(llava, refs):
    from sglbus import Engine

    with Engine(model_path=llava[1], dtype="float32", tp_size=2) as e:
        out = e.generate(input_ids=[ONE, TWO], image_data=[CAT, [CAT, DOG]], sampling_params=GREEDY)
        assert [o["output_ids"] for o in out] == [refs["one"], refs["two"]]
        e.check_integrity()


@pytest.fixture(scope="module")
def chat_engine(llava, tmp_path_factory):
    """An Engine on a copy of the tiny LLaVA whose tokenizer encodes `<image>` as its image token."""
    import shutil

    from sglbus import Engine

    folder = str(tmp_path_factory.mktemp("llava-chat") / "model")
    shutil.copytree(llava[1], folder)
    give_image_token(folder)
    with Engine(model_path=folder, dtype="float32", chunked_prefill_size=12) as e:
        yield e
        e.check_integrity()


def test_a_chat_with_an_image_equals_generate_on_its_rendered_prompt(llava, chat_engine):
    """/v1/chat/completions (OpenAIServing over the Engine's request manager) with a data URL: the
    image part becomes `<image>` where it was (SmolLM2's ChatML template reads strings), and greedy
    output equals `/generate` on the rendered text with the same image, and transformers' on its ids."""
    import orjson

    from services.gateway.openai_serving import OpenAIServing

    url = "data:image/png;base64," + base64.b64encode(CAT).decode()
    content = [{"type": "text", "text": "Look: "},
               {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
               {"type": "text", "text": " what is it?"}]  # fmt: skip
    body = {"model": "llava", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": NEW, "ignore_eos": True, "logprobs": True}  # fmt: skip
    serving = OpenAIServing(chat_engine.requests, lambda: ("llava",))

    async def chat() -> dict:
        _, parsed = await serving.parse("chat", orjson.dumps(body))
        assert not isinstance(parsed, Exception), parsed
        return await serving.answer(await serving.submit(*parsed))

    answer = chat_engine._run(chat())
    tok = chat_engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Look: <image> what is it?"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    ids = tok.encode(text)
    assert ids.count(IMAGE) == 1
    ref = chat_engine.generate(text=text, image_data=url, sampling_params=GREEDY)
    assert ref["output_ids"] == llava_greedy(llava[0], ids, [CAT])
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == ref["text"]
    assert [t["token"] for t in choice["logprobs"]["content"]] == [tok.decode([t]) for t in ref["output_ids"]]
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids) - 1 + TOKENS, NEW)
    assert usage["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
