"""Image inputs (shared/media.py): every form a client may send decodes to the same pixels, everything
else is refused with a message naming the field, and the preprocessing equals transformers'
CLIPImageProcessor (its PIL backend) on LLaVA-1.5's config and a small one."""

from __future__ import annotations

import base64
import io
import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_families import LLAVA_15_PREPROCESSOR

from shared.media import ClipPreprocess, MediaError, MediaLimits, image_hash, load_image, load_images

LLAVA = LLAVA_15_PREPROCESSOR
SMALL = {"size": {"shortest_edge": 32}, "crop_size": {"height": 28, "width": 28}}
OPENAI_INTS = {"size": 336, "crop_size": 336}  # openai/clip-vit-large-patch14-336 writes plain ints
PADDED = {"size": {"height": 20, "width": 23}, "crop_size": {"height": 27, "width": 25}}  # crop > image
ODD = {"size": {"shortest_edge": 31}, "crop_size": {"height": 27, "width": 24}, "resample": 2}
PLAIN = {"size": {"shortest_edge": 30}, "do_center_crop": False, "do_normalize": False}
SIZES = [(64, 48), (48, 64), (37, 53), (7, 5), (5, 7), (1, 40), (401, 400), (500, 350)]
LIMITS = MediaLimits()


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """A gradient with noise: resampling and cropping errors show, and JPEG keeps it recognisable."""
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    noisy = base + rng.normal(0, 25, base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def refused(item, limits: MediaLimits = LIMITS, *words: str, field: str = "image_data[1]") -> str:
    """The MediaError's message; it names the field and each of `words`."""
    with pytest.raises(MediaError) as caught:
        load_image(item, field, limits)
    message = str(caught.value)
    assert caught.value.field == field and message.startswith(field + ": ")
    for word in words:
        assert word in message, (word, message)
    return message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("size", [(64, 48), (37, 53), (7, 5)])
def test_every_form_loads_the_same_pixels(tmp_path: Path, fmt: str, size: tuple[int, int]) -> None:
    data = encode(picture(*size), fmt)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    text = b64(data)
    (tmp_path / f"pic.{fmt.lower()}").write_bytes(data)
    forms = [
        data,
        bytearray(data),
        text,
        text.rstrip("="),
        base64.encodebytes(data).decode(),  # line breaks every 76 characters
        base64.urlsafe_b64encode(data).decode().rstrip("="),
        f"  {text}\n",
        f"data:image/{fmt.lower()};base64,{text}",
        f"DATA:IMAGE/{fmt};BASE64,{text.rstrip('=')}",
        f"pic.{fmt.lower()}",
        str(tmp_path / f"pic.{fmt.lower()}"),
    ]
    limits = MediaLimits(media_dir=str(tmp_path))
    for form in forms:
        image = load_image(form, "image_data", limits)
        assert image.mode == "RGB" and image.size == size
        np.testing.assert_array_equal(np.asarray(image), expected)


def test_file_paths_stay_inside_the_media_folder(tmp_path: Path) -> None:
    media, outside = tmp_path / "media", tmp_path / "outside"
    (media / "sub").mkdir(parents=True)
    outside.mkdir()
    data = encode(picture(9, 6))
    (media / "sub" / "a.png").write_bytes(data)
    (outside / "b.png").write_bytes(data)
    (media / "link_in.png").symlink_to(media / "sub" / "a.png")
    (media / "link_out.png").symlink_to(outside / "b.png")
    (media / "dir_out").symlink_to(outside)
    limits = MediaLimits(media_dir=str(media))
    for path in ["sub/a.png", str(media / "sub" / "a.png"), "link_in.png", "sub/../sub/a.png"]:
        assert load_image(path, "image_data", limits).size == (9, 6)
    for path in [str(outside / "b.png"), "../outside/b.png", "sub/../../outside/b.png", "link_out.png"]:
        refused(path, limits, "outside the server's allowed media folder", "--allowed-media-dir")
    refused("dir_out/b.png", limits, "outside the server's allowed media folder")
    refused("sub/missing.png", limits, "cannot read the file", "No such file")
    refused("sub/a\0.png", limits, "not a file path")
    (media / "folder.png").mkdir()
    refused("folder.png", limits, "cannot read the file", "Is a directory")
    os.mkfifo(media / "pipe.png")  # opening it must not block
    refused("pipe.png", limits, "not a regular file")
    (media / "text.png").write_bytes(b"not an image")
    refused("text.png", limits, "not an image")
    for path in ["sub/a.png", str(outside / "b.png"), "./a.png", "C:\\pics\\a.bin"]:
        for no_folder in [LIMITS, MediaLimits(media_dir="")]:
            refused(
                path, no_folder, "file paths need the server's allowed media folder", "--allowed-media-dir"
            )


def test_urls_are_not_fetched() -> None:
    for url in ["http://example.com/cat.png", "https://example.com/x", "HTTPS://EXAMPLE.COM/A", "ftp://h/a"]:
        refused(url, LIMITS, "URLs are not fetched", "offline", "base64", "data URL")


def test_truncated_and_undecodable_data_is_refused() -> None:
    for fmt in ["PNG", "JPEG"]:
        data = encode(picture(120, 90), fmt)
        for cut in [len(data) // 2, len(data) - 30]:
            refused(data[:cut], LIMITS, "truncated or corrupt")
            refused(b64(data[:cut]), LIMITS, "truncated or corrupt")
    refused(b"hello, world", LIMITS, "not an image", "PNG, JPEG")
    refused(b64(b"hello, world, this is text"), LIMITS, "not an image")
    refused(encode(picture(8, 8), "TIFF"), LIMITS, "not an image")  # a format not on the list
    refused("abcde", LIMITS, "not valid base64")
    refused("ab=cd", LIMITS, "not valid base64")
    refused("data:text/plain;base64,aGVsbG8=", LIMITS, "data:image/<type>;base64,<data>")
    refused("data:image/png,rawtext", LIMITS, "data:image/<type>;base64,<data>")
    refused("data:image/png;base64,@@@", LIMITS, "not valid base64")
    refused("   ", LIMITS, "empty", "base64")
    refused(12, LIMITS, "expected a string or bytes, got int")


def png_header(width: int, height: int) -> bytes:
    """A PNG that only claims its size: what a decompression bomb looks like to Image.open."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_limits() -> None:
    data = encode(picture(20, 10))
    with pytest.raises(MediaError) as caught:  # the count first: none of these is decoded
        load_images([b"junk"] * 3, "image_data", MediaLimits(max_images=2))
    assert caught.value.field == "image_data" and "3 images; at most 2 per request" in str(caught.value)
    assert len(load_images([data, b64(data)], "image_data", MediaLimits(max_images=2))) == 2
    assert [i.size for i in load_images(data, "image_data", LIMITS)] == [(20, 10)]
    with pytest.raises(MediaError, match=r"^image_data\[1\]: not an image"):
        load_images([data, b"junk"], "image_data", LIMITS)

    refused(data, MediaLimits(max_pixels=199), "the image is 20x10; at most 199 pixels (width*height)")
    assert load_image(data, "image_data", MediaLimits(max_pixels=200)).size == (20, 10)
    refused(png_header(7000, 7000), LIMITS, "the image is 7000x7000; at most 36000000 pixels")
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")  # Pillow's DecompressionBombWarning becomes our error, not a warning
        refused(png_header(10_000, 10_000), LIMITS, "over Pillow's limit", "at most 36000000 pixels")  # warns
        huge = MediaLimits(max_pixels=10**12)
        refused(
            png_header(100_000, 100_000), huge, f"over Pillow's limit of {Image.MAX_IMAGE_PIXELS}"
        )  # Pillow raises
    assert caught_warnings == []

    small = MediaLimits(max_bytes=len(data) - 1, media_dir=os.path.dirname(__file__))
    for form in [data, b64(data), f"data:image/png;base64,{b64(data)}"]:
        refused(form, small, f"the image is {len(data)} bytes; at most {len(data) - 1} bytes")
    assert load_image(data, "image_data", MediaLimits(max_bytes=len(data))).size == (20, 10)


def test_file_size_limit(tmp_path: Path) -> None:
    data = encode(picture(20, 10))
    (tmp_path / "a.png").write_bytes(data)
    refused("a.png", MediaLimits(max_bytes=100, media_dir=str(tmp_path)), f"{len(data)} bytes; at most 100")


def test_exif_orientation_and_transparency_as_transformers() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: a phone held upright
    assert load_image(encode(picture(30, 20), "JPEG", exif=exif), "x", LIMITS).size == (20, 30)
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, 0  # fully transparent red: white once composited, as transformers
    image = load_image(encode(Image.fromarray(rgba, "RGBA")), "x", LIMITS)
    assert (np.asarray(image) == 255).all()


@pytest.fixture(scope="module")
def clip_pil():
    """transformers' slow CLIP processor: CLIPImageProcessorPil in transformers 5, where the default
    CLIPImageProcessor is the torchvision one; CLIPImageProcessor itself in transformers 4."""
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor


@pytest.mark.parametrize("config", [LLAVA, SMALL, OPENAI_INTS, PADDED, ODD, PLAIN], ids=lambda c: str(c)[:40])
def test_preprocessing_equals_transformers(clip_pil, config: dict) -> None:
    processor, ours = clip_pil(**config), ClipPreprocess(config)
    for seed, (width, height) in enumerate(SIZES):
        image = picture(width, height, seed)
        expected = processor(images=image, return_tensors="np")["pixel_values"][0]
        got = ours.pixels(image)
        assert got.dtype == np.float32 and got.shape == expected.shape, (width, height)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
        small = ours.uint8(image)
        assert small.dtype == np.uint8 and small.shape == (*expected.shape[1:], 3)
        np.testing.assert_array_equal(ours.normalize(small), got)
    # an image with transparency, decoded here first, as transformers does with the file
    rgba = np.asarray(picture(45, 33, 9).convert("RGBA")).copy()
    rgba[..., 3] = np.arange(45, dtype=np.uint8)[None, :] * 5
    data = encode(Image.fromarray(rgba, "RGBA"))
    expected = processor(images=Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(ours.pixels(load_image(data, "x", LIMITS)), expected, rtol=0, atol=1e-5)


def test_llava_shapes_and_the_resize_cap() -> None:
    llava = ClipPreprocess(LLAVA)
    assert llava.resized_shape(480, 640) == (336, 448)
    assert llava.resized_shape(7, 5) == (470, 336)  # 336 * 7 / 5 = 470.4, truncated, not rounded
    assert llava.pixels(picture(7, 5)).shape == (3, 336, 336)
    capped = ClipPreprocess(SMALL, max_resized_pixels=100_000)
    assert capped.uint8(picture(1, 90)).shape == (28, 28, 3)  # 32 x 2880
    with pytest.raises(MediaError, match=r"^image_data\[0\]: .*aspect ratio is too extreme"):
        capped.uint8(picture(1, 200), "image_data[0]")  # 32 x 6400
    with pytest.raises(ValueError, match="shortest_edge"):
        ClipPreprocess({"size": {"shortest_edge": 3, "longest_edge": 9}})


def test_image_hash_is_the_picture_not_its_encoding() -> None:
    llava = ClipPreprocess(SMALL)
    data = encode(picture(50, 40))
    keys = {
        image_hash(llava.uint8(load_image(form, "x", LIMITS)))
        for form in [data, b64(data), f"data:image/png;base64,{b64(data)}"]
    }
    assert len(keys) == 1
    key = keys.pop()
    assert 0 <= key < 1 << 64
    assert key == image_hash(llava.uint8(picture(50, 40)))  # stable: the same on every call and process
    assert image_hash(llava.uint8(picture(50, 40, seed=1))) != key
    assert image_hash(llava.uint8(load_image(encode(picture(50, 40), "JPEG"), "x", LIMITS))) != key
    flat = np.zeros((4, 6, 3), np.uint8)
    assert image_hash(flat) != image_hash(flat.reshape(6, 4, 3))  # the shape is part of the key
