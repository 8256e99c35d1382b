"""LLaVA-NeXT's any-resolution arithmetic, shared by the gateway (how many placeholder slots and tiles
a picture takes: shared/media.py `AnyResPreprocess`) and the model (how its tiles' rows are packed:
services/scheduler/models/llava_next.py), so the two can never disagree: the pinpoint a picture goes
to, the padding cut from its feature map, and the rows it takes in the prompt. The expressions are
transformers' own (`select_best_resolution`, `unpad_image`, the processor's `_get_unpadded_features`,
float rounding included)."""

from __future__ import annotations

from collections.abc import Sequence

# LlavaNextConfig's default `image_grid_pinpoints` ((height, width) pairs), which a saved config leaves out
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def select_best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` a height x width picture is resized into: the most of the
    picture's pixels kept (scaled to fit, truncated), then the least padding; the first such wins."""
    best, most_kept, least_wasted = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (int(h), int(w)), kept, wasted
    assert best is not None, "no pinpoints"
    return best


def unpad_margins(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """(rows, cols) cut from each side of a rows x cols feature map of a height x width picture that
    was resized into it and padded to it, centred: the padding, in patches."""
    if width / height > cols / rows:  # wider than the map: padded above and below
        kept = int(round(height * (cols / width), 7))
        return (rows - kept) // 2, 0
    kept = int(round(width * (rows / height), 7))
    return 0, (cols - kept) // 2


def grid_shape(height: int, width: int, pinpoints: Sequence[Sequence[int]], tile: int) -> tuple[int, int]:
    """(rows, cols) of `tile`-sized grid tiles the picture's features are laid out in (the base tile
    not counted): `get_anyres_image_grid_shape`, which floors."""
    h, w = select_best_resolution(height, width, pinpoints)
    return h // tile, w // tile


def image_tokens(height: int, width: int, pinpoints: Sequence[Sequence[int]], tile: int, grid: int) -> int:
    """Rows a height x width picture takes in the prompt: the base tile's grid*grid, then the unpadded
    map of the grid tiles' patches, a newline row after each of its rows (`grid`: patches per tile side)."""
    rows, cols = (n * grid for n in grid_shape(height, width, pinpoints, tile))
    cut_rows, cut_cols = unpad_margins(height, width, rows, cols)
    rows, cols = rows - 2 * cut_rows, cols - 2 * cut_cols
    return grid * grid + rows * (cols + 1)
