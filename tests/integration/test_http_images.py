"""A tiny LLaVA served over the bus (a real nats-server, gateway, scheduler and detokenizer processes):
the official openai client sends a chat with an image (a data URL), and its answer equals `/generate`
on the rendered prompt with that image; `/generate` with two images and base64; a bad image is a 400
naming its field while the next request completes; a text model's server refuses images by name."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from conftest import ServerProcs, start_server
from tiny_families import IMAGE, give_image_token, llava_folder

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def png(seed: int, size: tuple[int, int]) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory, model_folder) -> Iterator[ServerProcs]:
    _, folder = llava_folder(tmp_path_factory, model_folder, "llava-http", seed=2)
    give_image_token(folder)
    s = start_server(env={"SGLBUS_MODEL_PATH": folder, "SGLBUS_DTYPE": "float32"})
    s.model_folder = folder
    yield s
    s.stop()


def test_the_openai_client_sends_an_image(llava_server):
    s, image = llava_server, png(0, (70, 60))
    url = f"data:image/png;base64,{image}"
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    with openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0) as client:
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=10,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    answer = chat.choices[0].message.content
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(s.model_folder)  # the image part is the image token where it was
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is this?<image>"}], tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    ref = s.http.post("/generate", json={"text": prompt, "image_data": url, "sampling_params": GREEDY}).json()
    assert answer == ref["text"]
    assert chat.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]


def test_generate_with_two_images_and_a_bad_one(llava_server):
    s = llava_server
    two = {"input_ids": [5, IMAGE, 6, IMAGE, 7], "image_data": [png(1, (56, 56)), png(2, (90, 40))],
           "sampling_params": GREEDY}  # fmt: skip
    first = s.http.post("/generate", json=two)
    assert first.status_code == 200, first.text
    assert first.json()["meta_info"]["prompt_tokens"] == 3 + 2 * 16
    again = s.http.post("/generate", json=two).json()
    assert again["output_ids"] == first.json()["output_ids"] and again["meta_info"]["cached_tokens"] >= 34
    truncated = base64.b64encode(base64.b64decode(png(3, (56, 56)))[:100]).decode()
    bad = s.http.post("/generate", json={**two, "image_data": [two["image_data"][0], truncated]})
    assert bad.status_code == 400 and "image_data[1]" in bad.text and "truncated" in bad.text, bad.text
    url = s.http.post("/generate", json={**two, "image_data": ["https://example.com/a.png", truncated]})
    assert url.status_code == 400 and "not fetched" in url.text
    assert s.http.post("/generate", json=two).json()["output_ids"] == first.json()["output_ids"]
    assert s.http.get("/get_model_info").json()["has_image_understanding"] is True


def test_the_frontend_sends_images_to_the_server(llava_server):
    """sgl.image against a served LLaVA (RuntimeEndpoint): the program's text equals /generate's on
    the same prompt and image."""
    import sglbus as sgl

    s, picture = llava_server, png(4, (64, 48))

    @sgl.function
    def describe(state, image):
        state += "Describe " + sgl.image(image) + " briefly:"
        state += sgl.gen("d", max_tokens=8, temperature=0)

    state = describe.run(image=base64.b64decode(picture), backend=sgl.RuntimeEndpoint(s.url))
    body = {"text": "Describe <image> briefly:", "image_data": picture,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8}}  # fmt: skip
    ref = s.http.post("/generate", json=body)
    assert ref.status_code == 200, ref.text
    assert state["d"] == ref.json()["text"]
