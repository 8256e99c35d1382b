"""Images and videos of a program, as the `image_data` items a `/generate` request carries.

As SGLang's frontend does, the client reads and encodes: a file path is read here and sent as base64
(a server does not read the client's files: ours reads paths only inside its `--allowed-media-dir`,
the offline Engine none), bytes are base64-encoded, and a data URL, a URL or a base64 string goes as
it is (the runtime decides what it accepts; ours fetches no URL). A video becomes `num_frames` frames
sampled evenly, each one image (one image token per frame): a LLaVA-1.5 model, which has no video
tower, takes a video that way. Decoding a video file needs PyAV (`pip install av`, the `video` extra),
imported only then; a video given as a list of frames needs no decoder.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

VIDEO_PACKAGE = "av"  # PyAV: its wheels bring their own FFmpeg, nothing to install on the system
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_FORMS = "a file path, bytes, a PIL image, a numpy array, a data URL or a base64 string"


def encode_image(source: Any, where: str = "image") -> str:
    """One image as an `image_data` item (a str, so that it goes in a JSON body as well as to the
    Engine). where names it in errors (`video frame 3`)."""
    if isinstance(source, bytes | bytearray | memoryview):
        return _b64(bytes(source))
    if isinstance(source, os.PathLike):
        return _b64(_read_file(os.fspath(source), where))
    if isinstance(source, str):
        return _encode_string(source, where)
    if _is_pil_image(source) or _is_array(source):
        return _b64(_png(source, where))
    raise TypeError(f"{where}: expected {_FORMS}, got {type(source).__name__}")


def video_frames(source: Any, num_frames: int) -> list[str]:
    """num_frames frames of a video, sampled evenly (`sample_indices`), as `image_data` items. source:
    a video file's path or bytes (decoded with PyAV), or the frames themselves (a list of what
    `encode_image` takes, or a numpy array of frames)."""
    if isinstance(source, str | os.PathLike | bytes | bytearray | memoryview):
        frames = _decode_video(source, num_frames)
    elif _is_array(source) and source.ndim == 4:
        frames = [source[i] for i in sample_indices(len(source), num_frames)]
    elif isinstance(source, Sequence) and source:
        frames = [source[i] for i in sample_indices(len(source), num_frames)]
    else:
        raise TypeError(
            f"video: expected a video file's path or bytes, or its frames (a non-empty list of {_FORMS}), "
            f"got {type(source).__name__}"
        )
    return [encode_image(f, f"video frame {i}") for i, f in enumerate(frames)]


def sample_indices(total: int, num_frames: int) -> list[int]:
    """num_frames indices spread evenly over total frames, first and last included (SGLang's
    `np.linspace(0, total - 1, num_frames, dtype=int)`, in exact integer arithmetic). A video shorter
    than num_frames repeats frames: the prompt gets num_frames images either way, as in SGLang."""
    if total < 1:
        raise ValueError("video: it has no frames")
    if num_frames == 1:
        return [0]
    return [i * (total - 1) // (num_frames - 1) for i in range(num_frames)]


# -- images --------------------------------------------------------------------------------------
def _encode_string(text: str, where: str) -> str:
    """A data URL or a URL as it is; an existing file read; else base64 as it is, or an error."""
    stripped = text.strip()
    if stripped[:5].lower() == "data:" or _SCHEME.match(stripped):
        return text
    if os.path.isfile(text):
        return _b64(_read_file(text, where))
    if stripped and _is_base64(stripped):
        return text
    raise FileNotFoundError(f"{where}: no file {text[:200]!r} (and not a data URL or base64); give {_FORMS}")


def _is_base64(text: str) -> bool:
    """Whether text decodes as base64 (standard or URL-safe, padding and line breaks optional)."""
    compact = re.sub(r"\s+", "", text).rstrip("=").translate(str.maketrans("-_", "+/"))
    if len(compact) % 4 == 1:  # no base64 string has this length
        return False
    try:
        base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _read_file(path: str, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise type(e)(e.errno, f"{where}: cannot read {path!r}: {e.strerror}") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _is_pil_image(x: Any) -> bool:
    pil = sys.modules.get("PIL.Image")  # a PIL image exists only if PIL was imported
    return pil is not None and isinstance(x, pil.Image)


def _is_array(x: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _png(image: Any, where: str) -> bytes:
    """A PIL image or an HxW(x3/x4) uint8 array as PNG bytes (lossless, as SGLang sends frames)."""
    from PIL import Image

    if not _is_pil_image(image):
        if image.ndim not in (2, 3) or image.dtype.name != "uint8":
            raise ValueError(
                f"{where}: a numpy image must be uint8 of shape (height, width) or (height, width, "
                f"channels), got {image.dtype.name} of shape {image.shape}"
            )
        image = Image.fromarray(image)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# -- video files ---------------------------------------------------------------------------------
def _decode_video(source: Any, num_frames: int) -> list[Any]:
    """The sampled frames of a video file (RGB arrays), spread over the container's frame count; when
    the container does not say it, or says more frames than it holds, over the frames counted by a
    decoding pass."""
    av = _import_av()
    total = _frame_count(av, source)
    frames = _frames_at(av, source, sample_indices(total, num_frames)) if total else None
    if frames is None:
        total = _frame_count(av, source, count=True)
        frames = _frames_at(av, source, sample_indices(total, num_frames))
    if frames is None:  # cannot happen: the frames were just counted
        raise ValueError(f"video: {_name(source)} gave fewer frames on a second reading")
    return frames


def _import_av() -> Any:
    try:
        import av
    except ImportError:
        raise ImportError(
            f"video: decoding a video file needs PyAV: pip install {VIDEO_PACKAGE} (or pip install "
            "'sglbus[video]'); or pass the frames themselves: sgl.video([frame, ...], num_frames) with "
            "image paths, bytes, PIL images or numpy arrays"
        ) from None
    return av


def _open(av: Any, source: Any) -> Any:
    if isinstance(source, bytes | bytearray | memoryview):
        source = io.BytesIO(bytes(source))
    elif not os.path.isfile(source):
        raise FileNotFoundError(f"video: no file {os.fspath(source)!r}")
    try:
        container = av.open(source)
    except av.error.FFmpegError as e:
        raise ValueError(f"video: cannot read {_name(source)} as a video: {e}") from None
    if not container.streams.video:
        container.close()
        raise ValueError(f"video: {_name(source)} has no video stream")
    return container


def _frame_count(av: Any, source: Any, count: bool = False) -> int:
    """The container's frame count (0: unknown), or with count=True the frames decoded."""
    with _open(av, source) as container:
        stream = container.streams.video[0]
        if not count:
            return max(int(stream.frames or 0), 0)
        try:
            return sum(1 for _ in container.decode(stream))
        except av.error.FFmpegError as e:
            raise ValueError(f"video: cannot decode {_name(source)}: {e}") from None


def _frames_at(av: Any, source: Any, indices: list[int]) -> list[Any] | None:
    """The frames at indices, in order (decoding stops after the last one); None when the video
    ends before that."""
    wanted: dict[int, Any] = dict.fromkeys(indices)
    last = max(indices)
    with _open(av, source) as container:
        try:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    wanted[i] = frame.to_ndarray(format="rgb24")
                if i == last:
                    return [wanted[j] for j in indices]
        except av.error.FFmpegError as e:
            raise ValueError(f"video: cannot decode {_name(source)}: {e}") from None
    return None


def _name(source: Any) -> str:
    if isinstance(source, io.BytesIO | bytes | bytearray | memoryview):
        return "the video bytes"
    return repr(os.fspath(source))
