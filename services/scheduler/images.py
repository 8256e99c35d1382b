"""A vision-language request's images inside the scheduler: checked on arrival (the bus is a trust
boundary), turned into the model's rows when a step computes their placeholder slots, and handed to
the forward as `ForwardBatch.mm`.

An image's placeholders are prompt[offset : offset + length] (shared/messages.py `ImageInput`); a step
may compute part of them (chunked prefill, or a cache hit that ends inside the image). The vision
tower runs once per image, for all of the step's new images at once, and its rows stay on the request
until every placeholder is computed (a retracted request computes them again). Rows already in the
prefix cache (the same image and prompt before) are never computed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.scheduler.forward_batch import MultimodalBatch
from shared.media import AnyResPreprocess, preprocessor_config, preprocessor_of
from shared.messages import GenerateReq, image_placeholder

if TYPE_CHECKING:
    from services.scheduler.request import Req


@dataclass
class ImageSpan:
    offset: int
    length: int
    tiles: np.ndarray  # uint8 [T, S, S, 3], resized and cropped (LLaVA-NeXT: the base image, then its grid)
    size: tuple[int, int]  # the picture's (height, width) as sent
    rows: torch.Tensor | None = field(default=None, repr=False)  # [length, hidden] once computed


@dataclass(frozen=True)
class Vision:
    """What the scheduler needs of a vision-language model: its tiles' size, how many tiles and rows a
    picture of a given size takes (the model's `num_tiles`, `num_image_tokens`), and how its processor
    normalises pixels."""

    image_size: int
    tiles_of: Callable[[int, int], int]
    tokens_of: Callable[[int, int], int]
    normalize: Callable[[np.ndarray], np.ndarray]  # uint8 [T, S, S, 3] -> float32 [T, 3, S, S]
    sized: bool  # rows depend on the picture's size (LLaVA-NeXT): the message must carry it

    @classmethod
    def of(cls, model: Any, folder: str) -> Vision:
        size = model.vision_tower.image_size
        sized = hasattr(model, "pinpoints")
        if sized:
            pre = AnyResPreprocess(preprocessor_config(folder, size), model.pinpoints)
            normalize = pre.normalize
        else:
            clip = preprocessor_of(folder, size)
            normalize = lambda tiles: np.stack([clip.normalize(t) for t in tiles])  # noqa: E731
        return cls(size, model.num_tiles, model.num_image_tokens, normalize, sized)

    def check(self, msg: GenerateReq, vocab_size: int) -> str | None:
        """Why these images cannot run (the 400's message), or None."""
        ids, end = msg.input_ids, 0
        for i, im in enumerate(msg.images):
            where = f"images[{i}]"
            if im.offset < end or im.offset + im.length > len(ids):
                return (
                    f"{where}: placeholders {im.offset}..{im.offset + im.length} overlap or pass the prompt"
                )
            if self.sized and min(im.image_height, im.image_width) < 1:
                return f"{where}: this model needs the picture's size (image_height, image_width)"
            h, w = im.image_height, im.image_width
            tiles, tokens = (
                (self.tiles_of(h, w), self.tokens_of(h, w)) if self.sized else (1, self.tokens_of(0, 0))
            )
            if im.length != tokens:
                return f"{where}: {im.length} placeholders; the model takes {tokens} for this picture"
            size = self.image_size
            if (im.height, im.width, im.tiles) != (size, size, tiles) or len(
                im.pixels
            ) != tiles * 3 * size * size:
                return f"{where}: pixels must be {tiles} uint8 tile(s) of {size}x{size}x3"
            pad = image_placeholder(vocab_size, im.hash)
            if any(t != pad for t in ids[im.offset : im.offset + im.length]):
                return f"{where}: its placeholders must all be {pad} (vocab_size + hash % 2**30)"
            end = im.offset + im.length
        lp = msg.logprob
        if lp is not None and 0 <= lp.start_len < end:
            return f"prompt logprobs cannot cover image placeholders: logprob_start_len must be >= {end}"
        return None

    def rows(self, batch: list[Req], runner: Any) -> MultimodalBatch | None:
        """The image rows this step's extends compute (batch in the step's token order), or None."""
        todo: list[ImageSpan] = []
        wanted: list[tuple[ImageSpan, int, int, int]] = []  # (span, first row, rows, flat index)
        start = 0
        for r in batch:
            c, n = r.num_computed, r.extend_len
            for s in r.images:
                a, b = max(c, s.offset), min(c + n, s.offset + s.length)
                if a < b:
                    if s.rows is None:
                        todo.append(s)
                    wanted.append((s, a - s.offset, b - a, start + a - c))
            start += n
        if not wanted:
            return None
        if todo:
            tiles = [torch.from_numpy(self.normalize(s.tiles)).to(runner.device) for s in todo]
            for s, x in zip(todo, runner.image_rows(tiles, [s.size for s in todo]), strict=True):
                s.rows = x
        embeds = torch.cat([s.rows[a : a + k] for s, a, k, _ in wanted])
        flat = [p + j for _, _, k, p in wanted for j in range(k)]
        for s, a, k, _ in wanted:
            if a + k == s.length:  # every placeholder computed now: the rows are done with
                s.rows = None
        return MultimodalBatch(embeds, torch.tensor(flat, dtype=torch.int64, device=runner.device))


def spans_of(msg: GenerateReq) -> list[ImageSpan]:
    out = []
    for im in msg.images:
        tiles = np.frombuffer(im.pixels, dtype=np.uint8).reshape(im.tiles, im.height, im.width, 3)
        out.append(ImageSpan(im.offset, im.length, tiles, (im.image_height, im.image_width)))
    return out


def text_ids_in_range(msg: GenerateReq, vocab_size: int) -> bool:
    """Every prompt id outside the images' placeholders is a token of the vocabulary."""
    ids, start = msg.input_ids, 0
    for im in [*msg.images, None]:
        end = len(ids) if im is None else im.offset
        part = ids[start:end]
        if part and (min(part) < 0 or max(part) >= vocab_size):
            return False
        if im is not None:
            start = im.offset + im.length
    return True
