"""LLaVA-NeXT (LLaVA-1.6, `LlavaNextForConditionalGeneration`): LLaVA-1.5's tower, projector and
language model (models/llava.py, subclassed here) seeing an image of any size through several tiles.

The processor picks the best of config.json's `image_grid_pinpoints` ((height, width) pairs, multiples
of the tower's size S) for the picture's original size, resizes the picture to fit it (aspect kept),
pads it to it and cuts it into an R x C grid of S x S tiles (row by row); in front of them it puts the
whole picture squashed to S x S (the base tile). All R*C + 1 tiles go through the tower and projector;
`image_features` then packs them as transformers' `pack_image_features` does: the base tile's rows,
then the grid's patch rows as one (R*h) x (C*w) map with the processor's padding cut away again
(`unpad_margins`) and the learnt `image_newline` row after each map row. So the rows an image takes
depend on its original size (`num_image_tokens`, the count the processor puts in the prompt).

Checkpoints: `model.image_newline` (transformers 5) or `image_newline` (transformers 4, the published
llava-hf folders) both reach the parameter `image_newline` through LLaVA's renames and `CausalLM`'s
dropped `model.`; every other tensor is named as in LLaVA-1.5."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import nn

from services.scheduler.models.decoder import CausalLM
from services.scheduler.models.layers import Piece
from services.scheduler.models.llava import llava_class
from services.scheduler.parallel.group import SINGLE_RANK, TensorParallel
from shared.anyres import DEFAULT_PINPOINTS, grid_shape, image_tokens, unpad_margins
from shared.model_config import ModelConfig


@cache
def llava_next_class(text_cls: type[CausalLM]) -> type[CausalLM]:
    """The LLaVA-NeXT model whose language model is `text_cls` (one class per family)."""
    base: type[CausalLM] = llava_class(text_cls)

    class LlavaNext(base):  # type: ignore[valid-type, misc]
        def __init__(
            self, config: ModelConfig, max_positions: int, dtype: torch.dtype | None = None,
            tp: TensorParallel = SINGLE_RANK,
        ) -> None:  # fmt: skip
            v: dict[str, Any] = config.vision or {}
            if v.get("vision_feature_select_strategy", "default") != "default":
                # "full" keeps CLIP's CLS row: a tile's hw + 1 rows cannot form its h x w map, and
                # transformers' own pack_image_features fails on it (view, then the newline's expand)
                raise ValueError(
                    "LLaVA-NeXT with vision_feature_select_strategy 'full' is not supported: CLIP's CLS "
                    "row leaves a tile's features no h x w grid to unpad (transformers fails on it too)"
                )
            super().__init__(config, max_positions, dtype, tp)
            size = self.vision_tower.image_size
            self.pinpoints = tuple(
                (int(h), int(w)) for h, w in v.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
            )
            if not self.pinpoints or any(h % size or w % size for h, w in self.pinpoints):
                raise ValueError(f"image_grid_pinpoints {self.pinpoints} must be multiples of {size}")
            # transformers' name; read by the loader as `image_newline` (see the module docstring)
            self.image_newline = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype))

        def grid_shape(self, height: int, width: int) -> tuple[int, int]:
            """(rows, cols) of tiles the processor cuts a height x width picture into (the base tile
            not counted)."""
            return grid_shape(height, width, self.pinpoints, self.vision_tower.image_size)

        def num_tiles(self, height: int, width: int) -> int:
            """Tiles `image_features` takes for a height x width picture: the base one and the grid."""
            rows, cols = self.grid_shape(height, width)
            return 1 + rows * cols

        def num_image_tokens(self, height: int, width: int) -> int:
            """Rows a height x width picture takes in the prompt (`image_features`' length): the base
            tile's h*w, then the unpadded grid map's rows, each with its newline."""
            t = self.vision_tower
            return image_tokens(height, width, self.pinpoints, t.image_size, t.grid)

        @torch.inference_mode()
        def image_features(self, tiles: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
            """One picture's preprocessed tiles [T, 3, S, S] (the base tile first, then the grid row by
            row, as the processor makes them; tiles past `num_tiles`, the processor's padding to a
            batch's largest picture, are dropped as transformers drops them) and its original
            (height, width) -> its packed rows [num_image_tokens, hidden] in the model's dtype."""
            height, width = (int(n) for n in image_size)
            n = self.num_tiles(height, width)
            if tiles.dim() != 4 or tiles.shape[0] < n:
                raise ValueError(
                    f"a {height}x{width} picture takes {n} tiles [n, 3, S, S]; got {tuple(tiles.shape)}"
                )
            features = self.projector(self.vision_tower(tiles[:n]))  # [n, g*g, hidden]
            return self.pack(features, height, width)

        def pack_rows(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
            n = self.num_tiles(*size)
            return self.pack(features[:n], *size)

        def pack(self, features: torch.Tensor, height: int, width: int) -> torch.Tensor:
            """Per-tile rows [1 + R*C, g*g, hidden] -> [tokens, hidden]: the base tile's, then the
            grid's as one (R*g) x (C*g) map, unpadded, a newline after each of its rows."""
            g, hidden = self.vision_tower.grid, features.shape[-1]
            rows, cols = self.grid_shape(height, width)
            grid = features[1:].view(rows, cols, g, g, hidden).permute(0, 2, 1, 3, 4)
            grid = grid.reshape(rows * g, cols * g, hidden)
            cut_rows, cut_cols = unpad_margins(height, width, rows * g, cols * g)
            grid = grid[cut_rows : rows * g - cut_rows, cut_cols : cols * g - cut_cols]
            newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, hidden)
            return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])

        def pieces(self) -> dict[str, Piece | tuple[Piece, ...]]:
            return super().pieces() | {"image_newline": Piece(self.image_newline)}

    LlavaNext.__name__ = LlavaNext.__qualname__ = f"LlavaNext{text_cls.__name__.removesuffix('ForCausalLM')}"
    return LlavaNext
