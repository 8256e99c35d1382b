"""Images in `/v1/chat/completions` (services/gateway/openai_images.py), without a model: image_url parts
become the request's image_data in order and the model's image token where each part was (a string
template) or where a template that reads typed parts puts it (llava-hf's); http(s) urls, images in a
text model's chat or outside user messages, bad parts and images that do not decode are 400s naming
the part; `/v1/completions` stays text-only."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import io
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from services.gateway.image_inputs import ImageInputs
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_images import image_error, template_takes_parts
from services.gateway.openai_requests import parse_chat, parse_completion
from services.gateway.openai_serving import OpenAIServing
from services.gateway.request_manager import RequestManager
from shared.media import ClipPreprocess, MediaError, MediaLimits
from shared.transport import InProcessTransport

MODELS = ("served",)
CAT = "data:image/png;base64,iVBORw0KGgo="  # not decoded before the request manager: any text will do
DOG = "aGVsbG8="  # base64 without the data URL's header
# llava-hf/llava-1.5-7b-hf's chat template: images first (each `<image>\n`), then the text parts
LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
    "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | selectattr("
    "'type', 'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def image(url: Any, detail: str | None = None) -> dict[str, Any]:
    spec = url if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": spec}


def text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [text("Compare "), image({"url": CAT}), text(" and "), image(DOG, "low")]},
    {"role": "assistant", "content": "Two pictures."},
    {"role": "user", "content": [image({"url": CAT, "detail": "high"}), text("Again?")]},
]


def chat(messages: list[dict[str, Any]], takes_images: bool = True, **extra: Any):
    """parse_chat with a stand-in template that keeps the messages it was given."""
    seen: list[list[dict[str, Any]]] = []

    def render(ms: list[dict[str, Any]]) -> list[int]:
        seen.append(ms)
        return [1]

    req = parse_chat({"messages": messages, **extra}, MODELS, render, None, takes_images)
    return req, seen[0]


def test_image_parts_become_image_data_in_order_and_image_parts_of_the_messages():
    req, messages = chat(copy.deepcopy(CONVERSATION))
    assert req.generate["image_data"] == [CAT, DOG, CAT]
    assert req.image_params == (
        "messages[1].content[1].image_url", "messages[1].content[3].image_url",
        "messages[3].content[0].image_url",
    )  # fmt: skip
    assert messages[1]["content"] == [text("Compare "), {"type": "image"}, text(" and "), {"type": "image"}]
    assert messages[3]["content"] == [{"type": "image"}, text("Again?")]
    assert messages[0]["content"] == "Be brief." and messages[2]["content"] == "Two pictures."
    # text-only lists stay one string, as before; no image_data then
    req, messages = chat([{"role": "user", "content": [text("a"), text("b")]}])
    assert messages[0]["content"] == "ab" and "image_data" not in req.generate and req.image_params == ()


@pytest.mark.parametrize(
    "content, param, words",
    [
        ([image("https://example.com/cat.png")], "messages[0].content[0].image_url", "not fetched"),
        ([text("x"), image({"url": "http://x/y.png"})], "messages[0].content[1].image_url", "offline"),
        ([image({"url": "file:///etc/cat.png"})], "messages[0].content[0].image_url", "not fetched"),
        ([image({"url": ""})], "messages[0].content[0].image_url", '"url"'),
        ([{"type": "image_url"}], "messages[0].content[0].image_url", '"url"'),
        ([image(CAT, "medium")], "messages[0].content[0].image_url.detail", "auto, low, high"),
        ([{"type": "input_audio", "input_audio": {}}], "messages", "allowed: text, image_url"),
        ([{"type": "text", "text": 3}], "messages", "messages[0].content[0].text must be a string"),
    ],
)
def test_a_bad_image_part_is_named(content, param, words):
    with pytest.raises(OpenAIError) as e:
        chat([{"role": "user", "content": content}])
    assert e.value.param == param and e.value.status == 400 and words in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_images_go_in_user_messages_only():
    with pytest.raises(OpenAIError) as e:
        chat([{"role": "system", "content": [image(CAT)]}, {"role": "user", "content": "hi"}])
    assert e.value.param == "messages[0].content[0]" and "user messages only" in e.value.message


def test_a_text_model_takes_no_images():
    with pytest.raises(OpenAIError) as e:
        chat([{"role": "user", "content": [text("what is it?"), image(CAT)]}], takes_images=False)
    assert e.value.param == "messages" and "messages[0].content[1]" in e.value.message
    assert "takes no images" in e.value.message


def test_completions_stay_text_only():
    with pytest.raises(OpenAIError) as e:
        parse_completion({"prompt": "<image> what is it?", "image_data": CAT}, MODELS)
    assert e.value.param == "image_data"


def test_a_refused_image_is_named_by_its_part():
    params = ("messages[1].content[1].image_url", "messages[3].content[0].image_url")
    e = image_error(MediaError("image_data[1]", "not an image"), params)
    assert (e.param, e.message) == (params[1], f"{params[1]}: not an image")
    many = image_error(MediaError("image_data", "17 images; at most 16 per request"), params)
    assert (many.param, many.message) == ("messages", "messages: 17 images; at most 16 per request")
    plain = image_error(MediaError("image_data", "x"), ())  # not a chat: as it was
    assert (plain.param, plain.message) == (None, "image_data: x")


def test_templates_that_read_typed_parts_are_told_apart():
    assert template_takes_parts(LLAVA)
    attr = "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}"
    aliased = (
        "{% for m in messages %}{% set ps = m['content'] %}{% for p in ps %}{{ p }}{% endfor %}{% endfor %}"
    )
    assert template_takes_parts(attr) and template_takes_parts(aliased)
    chatml = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}{% endfor %}"
    assert not template_takes_parts(chatml)
    assert not template_takes_parts(None) and not template_takes_parts("{% for x in %}")


# -- rendered with a real tokenizer --------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(model_folder):
    """The default model's tokenizer (SmolLM2, a ChatML template) with `<image>` as an added token."""
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(model_folder)
    tok.add_tokens(["<image>"], special_tokens=True)
    return tok


@contextlib.contextmanager
def serving_of(tok: Any, token_id: int | None, template: str | None = None) -> Iterator[OpenAIServing]:
    """OpenAIServing over a request manager that is never started (nothing reaches a scheduler);
    token_id: the model's image token (None: a text model)."""
    tok = copy.copy(tok)
    if template is not None:
        tok.chat_template = template
    images = None
    if token_id is not None:
        clip = ClipPreprocess({"size": {"shortest_edge": 56}, "crop_size": 56})
        images = ImageInputs(token_id, 16, len(tok), clip, MediaLimits(), "<image>")
    requests = RequestManager(tok, InProcessTransport(), "sglbus", len(tok), images=images)
    try:
        yield OpenAIServing(requests, lambda: MODELS)
    finally:
        requests._pool.shutdown(wait=True)


@pytest.fixture
def chatml(tokenizer) -> Iterator[OpenAIServing]:
    with serving_of(tokenizer, tokenizer.convert_tokens_to_ids("<image>")) as serving:
        yield serving


@pytest.fixture
def llava_template(tokenizer) -> Iterator[OpenAIServing]:
    with serving_of(tokenizer, tokenizer.convert_tokens_to_ids("<image>"), LLAVA) as serving:
        yield serving


def parsed(serving: OpenAIServing, messages: list[dict[str, Any]], **extra: Any):
    stream, result = serving.parse_here("chat", orjson.dumps({"messages": messages, **extra}))
    if isinstance(result, OpenAIError):
        raise result
    return result


def rendered(serving: OpenAIServing, ids: list[int]) -> str:
    return serving.tokenizer.decode(ids)


def test_a_string_template_gets_the_image_token_where_each_part_was(chatml):
    req, gen = parsed(chatml, copy.deepcopy(CONVERSATION))
    (prompt,) = gen.prompts
    assert prompt.images == [CAT, DOG, CAT]
    assert rendered(chatml, prompt.input_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare <image> and <image><|im_end|>\n"
        "<|im_start|>assistant\nTwo pictures.<|im_end|>\n<|im_start|>user\n<image>Again?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.input_ids.count(chatml.requests.images.image_token_id) == 3


def test_a_template_that_reads_parts_places_the_images_itself(llava_template):
    req, gen = parsed(llava_template, copy.deepcopy(CONVERSATION))
    (prompt,) = gen.prompts
    assert prompt.images == [CAT, DOG, CAT]
    # llava-1.5's template: each image as `<image>\n` before the message's text; string messages too
    assert rendered(llava_template, prompt.input_ids) == (
        "Be brief. USER: <image>\n<image>\nCompare   and  ASSISTANT: Two pictures. USER: <image>\nAgain? "
        "ASSISTANT:"
    )


def test_the_image_token_typed_in_the_text_is_refused(chatml):
    with pytest.raises(OpenAIError) as e:
        parsed(chatml, [{"role": "user", "content": [text("<image> here: "), image(CAT)]}])
    assert e.value.param == "messages" and "2 image tokens" in e.value.message
    assert "leave '<image>' out of the text" in e.value.message
    with pytest.raises(OpenAIError, match="1 image tokens .* for 0 image_url parts"):
        parsed(chatml, [{"role": "user", "content": "what is <image>?"}])


def test_a_tokenizer_without_the_image_token_is_said(tokenizer):
    """id 49151 is a plain piece of SmolLM2's vocabulary: `<image>` never becomes it."""
    with serving_of(tokenizer, 49151) as serving, pytest.raises(OpenAIError) as e:
        parsed(serving, [{"role": "user", "content": [image(CAT), text("what is it?")]}])
    assert e.value.param == "messages" and "must encode '<image>' as id 49151" in e.value.message


def png() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (60, 40), (200, 30, 90)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_an_image_that_does_not_decode_is_named_by_its_part(chatml):
    """The first image decodes; the second (the request's image_data[1]) is refused by its part."""
    bad = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    messages = [{"role": "user", "content": [text("a"), image(png()), text("b"), image({"url": bad})]}]
    req, gen = parsed(chatml, messages)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(chatml.submit(req, gen))
    assert e.value.param == "messages[0].content[3].image_url" and e.value.status == 400
    assert e.value.message.startswith("messages[0].content[3].image_url: not an image")


def test_a_text_model_serving_refuses_image_parts(tokenizer):
    with serving_of(tokenizer, None) as serving, pytest.raises(OpenAIError, match="takes no images") as e:
        parsed(serving, [{"role": "user", "content": [image(CAT)]}])
    assert e.value.param == "messages"
