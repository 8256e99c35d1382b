"""The gateway's side of a vision-language (LLaVA-style) prompt: its images loaded and preprocessed
here, once, and each image token of its ids expanded into the image's placeholder slots.

Each slot of an image holds `vocab_size + hash % 2**30` (shared/messages.py `ImageInput`): ids the
vocabulary never uses, equal for the same picture and different for another, so the scheduler's prefix
cache reuses an image's rows only for that image. The pixels go on the bus as uint8, resized and cropped
(`ClipPreprocess.uint8`); the scheduler normalises them. Every refusal is a `ValueError` (a 400) that
names the field."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.generate_input import Prompt
from shared.anyres import DEFAULT_PINPOINTS, image_tokens
from shared.media import (
    AnyResPreprocess,
    ClipPreprocess,
    MediaError,
    MediaLimits,
    image_hash,
    load_image,
    preprocessor_config,
    preprocessor_of,
)
from shared.messages import ImageInput, image_placeholder
from shared.model_config import ModelConfig

_CLIP = {"image_size": 224, "patch_size": 32}  # CLIPVisionConfig's defaults: a saved config omits them
_STRATEGIES = ("default", "full")  # vision_feature_select_strategy: "full" keeps the CLS token's row
_BUS_MARGIN = 1 << 16  # room in a bus message for everything besides the pixels and the ids
_NO_VISION = (
    "image_data: this model (a text model: its config.json names no vision tower) takes no images; "
    "leave image_data unset, or serve a vision-language model (LlavaForConditionalGeneration)"
)


@dataclass(frozen=True)
class AnyRes:
    """LLaVA-NeXT: the rows a picture takes depend on its size (shared/anyres.py)."""

    pinpoints: tuple[tuple[int, int], ...]
    tile: int  # the vision tower's image size
    grid: int  # its patches per side

    def tokens(self, height: int, width: int) -> int:
        return image_tokens(height, width, self.pinpoints, self.tile, self.grid)


@dataclass(frozen=True)
class ImageInputs:
    """What the gateway needs of a vision-language model: its image token, the slots an image takes,
    how its processor resizes and crops, and the caps on what a request may send."""

    image_token_id: int
    tokens_per_image: int  # LLaVA-1.5's; LLaVA-NeXT's depend on the picture (`anyres`)
    vocab_size: int
    preprocess: ClipPreprocess | AnyResPreprocess
    limits: MediaLimits
    image_token: str = "<image>"  # the token's text, for messages
    anyres: AnyRes | None = None  # LLaVA-NeXT: tiles and rows by the picture's size

    @classmethod
    def from_folder(cls, folder: str, vocab_size: int, limits: MediaLimits) -> ImageInputs | None:
        """The model folder's (config.json, preprocessor_config.json); None for a text model. A config
        the gateway cannot serve images with is a ValueError at start, not a 400 on every image."""
        vision = ModelConfig.from_folder(folder).vision
        if vision is None:
            return None
        size, tokens, grid = _tower_shape(vision)
        preprocess: ClipPreprocess | AnyResPreprocess = preprocessor_of(folder, size)
        _check_output_size(preprocess, size)
        anyres = None
        if vision.get("architectures", [""])[0] == "LlavaNextForConditionalGeneration":
            pinpoints = vision.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
            preprocess = AnyResPreprocess(preprocessor_config(folder, size), pinpoints)
            anyres = AnyRes(tuple((int(h), int(w)) for h, w in pinpoints), size, grid)
        token_id = vision.get("image_token_index", vision.get("image_token_id"))
        token_id = 32000 if token_id is None else int(token_id)  # LlavaConfig's default
        return cls(token_id, tokens, vocab_size, preprocess, limits, _token_text(folder, token_id), anyres)

    def expand(
        self, ids: list[int], items: Any, field: str = "image_data"
    ) -> tuple[list[int], list[ImageInput]]:
        """ids with each image token replaced by its image's `tokens_per_image` placeholders, and the
        images (offsets into the expanded ids), in prompt order. Each image is decoded and preprocessed
        before the next is read: a request holds one decoded picture at a time, not all of them."""
        listed = [items] if isinstance(items, str | bytes | bytearray | memoryview) else items
        if not isinstance(listed, Sequence):
            raise MediaError(field, f"expected an image or a list of images, got {type(items).__name__}")
        if len(listed) > self.limits.max_images:
            raise MediaError(field, f"{len(listed)} images; at most {self.limits.max_images} per request")
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(listed):
            raise ValueError(
                f"{field} has {_count(len(listed), 'image')} but the prompt has "
                f"{_count(len(slots), 'image token')} ({self.image_token}, id {self.image_token_id}): "
                "put one where each image goes"
            )
        out: list[int] = []
        images: list[ImageInput] = []
        start = 0
        for k, (slot, item) in enumerate(zip(slots, listed, strict=True)):
            name = field if listed is not items else f"{field}[{k}]"
            out += ids[start:slot]
            images.append(self._image(item, name, len(out)))
            out += [image_placeholder(self.vocab_size, images[-1].hash)] * images[-1].length
            start = slot + 1
        out += ids[start:]
        return out, images

    def _image(self, item: Any, field: str, offset: int) -> ImageInput:
        image = load_image(item, field, self.limits)
        if isinstance(self.preprocess, AnyResPreprocess):
            tiles, length = self.preprocess.tiles(image, field), self.anyres.tokens(image.height, image.width)
        else:
            tiles, length = self.preprocess.uint8(image, field)[None], self.tokens_per_image
        return ImageInput(offset=offset, length=length, hash=image_hash(tiles), pixels=tiles.tobytes(),
                          height=tiles.shape[1], width=tiles.shape[2], tiles=tiles.shape[0],
                          image_height=image.height, image_width=image.width)  # fmt: skip

    @staticmethod
    def check_logprobs(start_len: int, images: list[ImageInput]) -> None:
        """Prompt logprobs (start_len >= 0) cannot cover an image's slots: their ids are no token of the
        vocabulary, so they start after the last image at the earliest."""
        if start_len < 0 or not images:
            return
        end = images[-1].offset + images[-1].length
        if start_len < end:
            raise ValueError(
                f"logprob_start_len {start_len} asks for prompt logprobs over image placeholders (the "
                f"prompt's images end at position {end}, with each image token expanded to its "
                f"{images[-1].length} slots); set logprob_start_len to at least {end}, or -1 for output "
                "logprobs only"
            )


def prompt_images(
    images: ImageInputs | None, p: Prompt, ids: list[int], field: str, context_len: int | None,
    max_payload: int,
) -> tuple[list[int], list[ImageInput]]:  # fmt: skip
    """The prompt's ids with its images expanded, and the images (none: ids as they are), after the
    checks that need the expanded ids: the context length, prompt logprobs, and one bus message.

    A prompt without image_data whose ids hold the image token is refused too: its token would reach
    the model as a text token, which it was never trained to see without an image."""
    if images is None:
        if p.images is not None:
            raise ValueError(_NO_VISION)
        return ids, []
    if p.images is None and images.image_token_id not in ids:
        return ids, []
    ids, inputs = images.expand(ids, [] if p.images is None else p.images, field)
    if context_len is not None:
        p.sampling.verify_length(len(ids), context_len)
    if p.logprob is not None:
        ImageInputs.check_logprobs(p.logprob.start_len, inputs)
    _check_bus_size(inputs, len(ids), p.sampling.n, max_payload)
    return ids, inputs


def _check_bus_size(inputs: list[ImageInput], prompt_len: int, n: int, max_payload: int) -> None:
    """A request goes to its scheduler in one bus message; with n > 1 it carries the prompt and its
    images once per sample and once more for the prefill (each may run on its own after an eviction)."""
    copies = n + 1 if n > 1 else 1
    pixels = sum(len(im.pixels) for im in inputs)
    size, limit = copies * (pixels + 5 * prompt_len), max_payload - _BUS_MARGIN  # an id: <= 5 bytes
    if size > limit:
        times = f"{copies} times (n = {n}, and the prefill)" if n > 1 else "once"
        raise ValueError(
            f"image_data: {_count(len(inputs), 'image')} ({pixels} bytes of pixels) and the prompt go to "
            f"the scheduler {times}: about {size} bytes, over the bus's {limit}-byte limit; send fewer "
            "images or ask for a smaller n"
        )


def _tower_shape(vision: dict[str, Any]) -> tuple[int, int, int]:
    """(image_size, rows per image, patches per side) of the vision tower: a patch grid, with the CLS
    token's row too under the "full" select strategy."""
    tower = {**_CLIP, **{k: v for k, v in (vision.get("vision_config") or {}).items() if v is not None}}
    size, patch = int(tower["image_size"]), int(tower["patch_size"])
    strategy = vision.get("vision_feature_select_strategy", "default")
    if strategy not in _STRATEGIES:
        allowed = ", ".join(_STRATEGIES)
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported; allowed: {allowed}")
    return size, (size // patch) ** 2 + (strategy == "full"), size // patch


def _check_output_size(preprocess: ClipPreprocess, size: int) -> None:
    """The processor must give the vision tower's size x size pixels, or every image would be refused
    by the scheduler: a mismatched preprocessor_config.json is said at start."""
    if preprocess.do_center_crop:
        out = (preprocess.crop_size["height"], preprocess.crop_size["width"])
    elif preprocess.do_resize and "height" in preprocess.size:
        out = (preprocess.size["height"], preprocess.size["width"])
    else:
        out = None  # the image's own shape: not fixed
    if out != (size, size):
        got = "images of their own shape" if out is None else f"{out[0]}x{out[1]} images"
        raise ValueError(
            f"preprocessor_config.json gives {got}; the vision tower takes {size}x{size} (image_size): "
            "set crop_size (with do_center_crop) or size to it"
        )


def _token_text(folder: str, token_id: int) -> str:
    """The image token's text from the tokenizer's added tokens, for messages; LLaVA's "<image>" when
    the folder does not say."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return str(json.load(f)["added_tokens_decoder"][str(token_id)]["content"])
    except (OSError, ValueError, KeyError, TypeError):
        return "<image>"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
