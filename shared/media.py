"""Image inputs of vision-language (LLaVA-style) requests: decoded, checked and preprocessed once.

Deployments are offline, so a URL is never fetched: clients send base64, a data URL or raw bytes, and file
paths are read only inside the folder the operator allowed (`--allowed-media-dir`). A refusal is a
`MediaError` (a `ValueError`: a 400) naming the field and what is allowed; caps on count, encoded bytes
and decoded pixels keep one request from taking the gateway's memory or CPU.

`ClipPreprocess` reproduces transformers' `CLIPImageProcessor` (PIL backend) exactly: the model sees the
pixels it was trained on. Its `uint8` stage (resized, cropped) is the compact form for the message bus (a
quarter of float32's bytes) and what `image_hash` reads."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import stat
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from shared.anyres import DEFAULT_PINPOINTS, select_best_resolution

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD: CLIPImageProcessor's defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# What Image.open may try: without a list Pillow tries every plugin it has (EPS would run Ghostscript)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # JPEG includes MPO, what many phone cameras write
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_BASE64 = re.compile(r"[A-Za-z0-9+/=_\-\s]+")  # standard and URL-safe alphabets, padding, line breaks
_SENT_AS = "send the image as base64 or a data URL (data:image/png;base64,...)"


class MediaError(ValueError):
    """A refused image input; `field` is where it was (`image_data[1]`), for the client's 400."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class MediaLimits:
    """Per-request caps; `media_dir` is the only folder file paths may name (None: paths are refused)."""

    max_images: int = 16
    max_bytes: int = 20 << 20  # encoded size of one image
    max_pixels: int = 36_000_000  # width*height of one decoded image: 6000x6000 is 108 MB as RGB
    media_dir: str | None = None


def load_images(items: Any, field: str, limits: MediaLimits) -> list[Image.Image]:
    """One item or a list of them, as RGB images; the count is checked before anything is decoded."""
    if isinstance(items, str | bytes | bytearray | memoryview):
        return [load_image(items, field, limits)]
    if not isinstance(items, Sequence):
        raise MediaError(field, f"expected an image or a list of images, got {type(items).__name__}")
    if len(items) > limits.max_images:
        raise MediaError(field, f"{len(items)} images; at most {limits.max_images} per request")
    return [load_image(item, f"{field}[{i}]", limits) for i, item in enumerate(items)]


def load_image(item: str | bytes, field: str, limits: MediaLimits) -> Image.Image:
    """Decode one image fully (a truncated file fails here, not in the model's batch) into RGB.

    A string is a data URL (`data:image/...;base64,`), or a file path when it ends in an image suffix or
    holds characters base64 does not use ('.'), or else base64 (padding and line breaks optional)."""
    data = _read(item, field, limits)
    _check_bytes(len(data), field, limits)
    cap = f"at most {limits.max_pixels} pixels (width*height) per image"
    try:
        with warnings.catch_warnings():  # Pillow's bomb check warns, then raises: both become ours
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            if image.width * image.height > limits.max_pixels:
                raise MediaError(field, f"the image is {image.width}x{image.height}; {cap}")
            image.load()
            ImageOps.exif_transpose(image, in_place=True)  # as transformers' load_image: photos upright
            return to_rgb(image)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise MediaError(field, f"the image is over Pillow's limit of {Image.MAX_IMAGE_PIXELS}; {cap}") from e
    except UnidentifiedImageError as e:
        raise MediaError(field, f"not an image; expected {', '.join(FORMATS)} data ({_SENT_AS})") from e
    except MediaError:
        raise
    except Exception as e:  # Pillow's decoders raise OSError, SyntaxError, ValueError, EOFError, ...
        raise MediaError(field, f"the image data is truncated or corrupt ({e}); {_SENT_AS}") from e


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb`: transparency is composited onto white (not dropped)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_bytes(size: int, field: str, limits: MediaLimits) -> None:
    if size > limits.max_bytes:
        raise MediaError(field, f"the image is {size} bytes; at most {limits.max_bytes} bytes per image")


def _read(item: Any, field: str, limits: MediaLimits) -> bytes:
    """The encoded image's bytes, from whichever form the client sent."""
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    if not isinstance(item, str):
        raise MediaError(field, f"expected a string or bytes, got {type(item).__name__}; {_SENT_AS}")
    text = item.strip()
    if not text:
        raise MediaError(field, f"empty; {_SENT_AS}")
    if text[:5].lower() == "data:":
        header, comma, payload = text.partition(",")
        params = [p.strip().lower() for p in header[5:].split(";")]
        if not comma or not params[0].startswith("image/") or params[-1] != "base64":
            raise MediaError(field, "a data URL must be data:image/<type>;base64,<data>")
        return _base64(payload, field, limits)
    if _SCHEME.match(text):
        raise MediaError(field, f"URLs are not fetched (this server is offline); {_SENT_AS}")
    if text.lower().endswith(IMAGE_SUFFIXES) or not _BASE64.fullmatch(text):
        return _read_file(text, field, limits)
    return _base64(text, field, limits)


def _base64(text: str, field: str, limits: MediaLimits) -> bytes:
    compact = re.sub(r"\s+", "", text).rstrip("=").translate(str.maketrans("-_", "+/"))
    _check_bytes(len(compact) * 3 // 4, field, limits)  # before decoding: no allocation for a huge one
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(field, f"not valid base64 ({e}); {_SENT_AS}") from e


def _read_file(path: str, field: str, limits: MediaLimits) -> bytes:
    """A file inside `media_dir` once every symlink and '..' is resolved; not a fifo or a device."""
    if not limits.media_dir:
        allowed = "file paths need the server's allowed media folder (start it with --allowed-media-dir)"
        raise MediaError(field, f"{allowed}; {_SENT_AS}")
    root = os.path.realpath(limits.media_dir)
    try:
        real = os.path.realpath(os.path.join(root, path))  # a relative path is relative to the folder
    except ValueError as e:  # a NUL character
        raise MediaError(field, f"not a file path ({e}); {_SENT_AS}") from e
    if os.path.commonpath([root, real]) != root:
        raise MediaError(field, "the file is outside the server's allowed media folder (--allowed-media-dir)")
    flags = os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)  # a fifo cannot block; no symlink swapped in
    try:
        with open(real, "rb", opener=lambda name, mode: os.open(name, mode | flags)) as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise MediaError(field, "not a regular file in the allowed media folder")
            _check_bytes(info.st_size, field, limits)
            return file.read(limits.max_bytes + 1)  # +1: a file that grew since fstat is still refused
    except OSError as e:
        raise MediaError(field, f"cannot read the file in the allowed media folder: {e.strerror}") from e


def image_hash(array: np.ndarray) -> int:
    """A stable unsigned 64-bit key of preprocessed pixels (shape included): the same picture gives the
    same key whichever way it was sent; Python's hash() is salted per process, so it cannot be used."""
    array = np.ascontiguousarray(array)
    digest = hashlib.blake2b(f"{array.dtype.str}{array.shape}".encode(), digest_size=8)
    digest.update(memoryview(array).cast("B"))
    return int.from_bytes(digest.digest(), "little")


class ClipPreprocess:
    """`CLIPImageProcessor` (the PIL backend, `CLIPImageProcessorPil` in transformers 5) from the model's
    preprocessor_config.json: resize in uint8 with PIL, center crop, rescale, normalize.

    `max_resized_pixels` caps the resize's output: a 1x36M-pixel strip resized to a shortest edge of 336
    would be 336x12e9, which transformers would try to allocate."""

    def __init__(self, config: Mapping[str, Any], max_resized_pixels: int = 36_000_000) -> None:
        def _get(key: str, default: Any) -> Any:  # null in the json: transformers' default
            return default if config.get(key) is None else config[key]

        size = _get("size", {"shortest_edge": 224})
        self.size = {"shortest_edge": size} if isinstance(size, int) else dict(size)
        crop = _get("crop_size", {"height": 224, "width": 224})
        self.crop_size = {"height": crop, "width": crop} if isinstance(crop, int) else dict(crop)
        if set(self.size) not in ({"shortest_edge"}, {"height", "width"}):
            raise ValueError(f"size must be {{'shortest_edge': N}} or {{'height', 'width'}}, got {size}")
        self.do_resize = bool(_get("do_resize", True))
        self.resample = Image.Resampling(int(_get("resample", Image.Resampling.BICUBIC)))
        self.do_center_crop = bool(_get("do_center_crop", True))
        self.do_rescale = bool(_get("do_rescale", True))
        self.rescale_factor = float(_get("rescale_factor", 1 / 255))
        self.do_normalize = bool(_get("do_normalize", True))
        self.mean = np.array(_get("image_mean", CLIP_MEAN), dtype=np.float32).reshape(-1, 1, 1)
        self.std = np.array(_get("image_std", CLIP_STD), dtype=np.float32).reshape(-1, 1, 1)
        self.max_resized_pixels = max_resized_pixels

    def resized_shape(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize; long edge int(n * long / short): truncated, not rounded."""
        if "shortest_edge" not in self.size:
            return self.size["height"], self.size["width"]
        n = self.size["shortest_edge"]
        if width <= height:
            return int(n * height / width), n
        return n, int(n * width / height)

    def uint8(self, image: Image.Image, field: str = "image") -> np.ndarray:
        """RGB [H, W, 3] uint8, resized and cropped: the compact form to send; `normalize` finishes it."""
        image = to_rgb(image)  # do_convert_rgb: the model takes 3 channels whatever the config says
        if self.do_resize:
            height, width = self.resized_shape(image.height, image.width)
            if height * width > self.max_resized_pixels:
                extreme = f"resized to {width}x{height}, over {self.max_resized_pixels} pixels"
                raise MediaError(field, f"the image's aspect ratio is too extreme: {extreme}")
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image)
        if self.do_center_crop:
            array = _center_crop(array, self.crop_size["height"], self.crop_size["width"])
        return np.ascontiguousarray(array)

    def normalize(self, array: np.ndarray) -> np.ndarray:
        """float32 [3, H, W] from `uint8`'s output: as transformers, rescaled in float64, then float32."""
        chw = array.transpose(2, 0, 1)
        out = (chw * np.float64(self.rescale_factor) if self.do_rescale else chw).astype(np.float32)
        if self.do_normalize:
            out = (out - self.mean) / self.std
        return np.ascontiguousarray(out)

    def pixels(self, image: Image.Image, field: str = "image") -> np.ndarray:
        """The model's input: float32 [3, H, W], equal to CLIPImageProcessor's pixel_values[0]."""
        return self.normalize(self.uint8(image, field))


def _center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop: an odd surplus loses its extra row/column at the bottom/right; an image
    smaller than the crop is first padded with black, the odd extra pixel of padding at the top/left."""
    h, w = array.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top < 0 or left < 0:
        padded = np.zeros((max(h, height), max(w, width), 3), dtype=array.dtype)
        padded[max(0, -top) : max(0, -top) + h, max(0, -left) : max(0, -left) + w] = array
        array, top, left = padded, max(0, top), max(0, left)
    return array[top : top + height, left : left + width]


def preprocessor_config(folder: str, image_size: int) -> dict[str, Any]:
    """The model folder's `preprocessor_config.json`; without one, CLIP's processor at the vision tower's
    `image_size` (shortest edge and crop), as LLaVA-1.5 ships it."""
    import json

    path = os.path.join(folder, "preprocessor_config.json")
    if not os.path.isfile(path):
        return {"size": {"shortest_edge": image_size}, "crop_size": image_size}
    with open(path) as f:
        return json.load(f)


def preprocessor_of(folder: str, image_size: int) -> ClipPreprocess:
    """`preprocessor_config`'s CLIP processor."""
    return ClipPreprocess(preprocessor_config(folder, image_size))


# transformers' LlavaNextImageProcessor default `image_grid_pinpoints`: (height, width) pairs
ANYRES_PINPOINTS = DEFAULT_PINPOINTS


class AnyResPreprocess:
    """LLaVA-NeXT's any-resolution preprocessing: transformers' `LlavaNextImageProcessor`, its PIL backend
    (`LlavaNextImageProcessorPil` in transformers 5), tile for tile.

    An image becomes 1 + rows*cols tiles: the whole image squashed to the base size (no aspect kept), then
    the grid of the pinpoint resolution that fits it best, cut row by row. Each tile then goes through the
    CLIP steps of the same config (resize, center crop), which `ClipPreprocess` already matches. `tiles` is
    the uint8 form for the bus; the batch padding to the most tiles (`do_pad`) is left out: each image keeps
    its own count, and transformers' extra tiles are zeros the model drops anyway."""

    def __init__(
        self,
        config: Mapping[str, Any],
        grid_pinpoints: Sequence[Sequence[int]] | None = None,
        max_resized_pixels: int = 36_000_000,
    ) -> None:
        self.clip = ClipPreprocess(config, max_resized_pixels)
        if grid_pinpoints is None:  # the model's config.json is what the model was trained with: preferred
            grid_pinpoints = config.get("image_grid_pinpoints") or ANYRES_PINPOINTS
        self.pinpoints = tuple((int(h), int(w)) for h, w in grid_pinpoints)
        if not self.pinpoints or min(min(p) for p in self.pinpoints) <= 0:
            raise ValueError(f"image_grid_pinpoints must be [height, width] pairs > 0, got {grid_pinpoints}")
        size = self.clip.size  # the base tile is resized straight to this, whatever the aspect
        self.base_size = (size["height"], size["width"]) if "height" in size else (size["shortest_edge"],) * 2
        self.patch_size = self.clip.crop_size["height"]  # transformers: crop_size's height cuts the grid

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `select_best_resolution` (shared/anyres.py)."""
        return select_best_resolution(height, width, self.pinpoints)

    def grid_shape(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of grid tiles: `get_anyres_image_grid_shape`, which the model uses to put the tiles'
        features back in place (its patch is the vision tower's image_size, the crop size here)."""
        best_h, best_w = self.best_resolution(height, width)
        return best_h // self.patch_size, best_w // self.patch_size

    def num_tiles(self, height: int, width: int) -> int:
        """`tiles`' T without the pixels: 1 + rows*cols, where a pinpoint the crop does not divide adds a
        partial row/column (which `grid_shape`, flooring as transformers' model does, leaves out)."""
        best_h, best_w = self.best_resolution(height, width)
        return 1 + -(-best_h // self.patch_size) * -(-best_w // self.patch_size)

    def tiles(self, image: Image.Image, field: str = "image") -> np.ndarray:
        """uint8 [T, S, S, 3]: the base tile, then the grid's tiles row by row; `normalize` finishes them."""
        image = to_rgb(image)  # do_convert_rgb, before anything else, as transformers
        target = self.best_resolution(image.height, image.width)
        height, width = _fit_within(image.height, image.width, target)
        grid = _pad_centered(np.asarray(image.resize((width, height), resample=self.clip.resample)), target)
        base_h, base_w = self.base_size
        base = np.asarray(image.resize((base_w, base_h), resample=self.clip.resample))
        patches = [base] + _divide(grid, self.patch_size)
        return np.stack([self.clip.uint8(Image.fromarray(np.ascontiguousarray(p)), field) for p in patches])

    def normalize(self, tiles: np.ndarray) -> np.ndarray:
        """float32 [T, 3, S, S] from `tiles`' output: each tile as `ClipPreprocess.normalize`, bit for bit."""
        return np.stack([self.clip.normalize(tile) for tile in tiles])

    def pixels(self, image: Image.Image, field: str = "image") -> np.ndarray:
        """The model's input: float32 [T, 3, S, S], LlavaNextImageProcessor's pixel_values[0][:T]."""
        return self.normalize(self.tiles(image, field))


def _fit_within(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' `get_patch_output_size`: scaled to fit `target`, aspect kept; the scaled edge is rounded
    up (ceil, unlike `select_best_resolution`'s truncation) and capped at the target's."""
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(int(np.ceil(height * scale_w)), target_h), target_w
    return target_h, min(int(np.ceil(width * scale_h)), target_w)


def _pad_centered(array: np.ndarray, target: tuple[int, int]) -> np.ndarray:
    """`_pad_for_patching`: black borders up to `target`; an odd extra row/column goes to the bottom/right
    (the opposite of `_center_crop`'s padding)."""
    (h, w), (target_h, target_w) = array.shape[:2], target
    top, left = (target_h - h) // 2, (target_w - w) // 2
    padded = np.zeros((target_h, target_w, *array.shape[2:]), dtype=array.dtype)
    padded[top : top + h, left : left + w] = array
    return padded


def _divide(array: np.ndarray, patch: int) -> list[np.ndarray]:
    """`divide_to_patches`: square patches row by row (the last row/column smaller if `patch` does not
    divide the grid, as transformers; the CLIP resize and crop then bring it to size)."""
    h, w = array.shape[:2]
    return [array[i : i + patch, j : j + patch] for i in range(0, h, patch) for j in range(0, w, patch)]
