"""LLaVA (1.5): a CLIP vision tower, an MLP projector, and a language model of one of the families here
(Llama/Vicuna, Mistral, Qwen2; `text_config`). An image becomes `tokens_per_image` rows of the text
model's embedding width (`image_features`); the prompt holds that many placeholder tokens where the
image goes, and the forward puts the image's rows there in place of token embeddings
(`ForwardBatch.mm`, `CausalLM.forward`).

Checkpoints come in two layouts, both read: transformers 5 writes `model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.weight`; the published llava-hf
folders (transformers 4) have `language_model.model.*`, `language_model.lm_head.weight`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

import torch

from services.scheduler.models.decoder import CausalLM
from services.scheduler.models.layers import Piece
from services.scheduler.models.vision.clip import ClipVisionTower
from services.scheduler.models.vision.projector import LlavaProjector
from services.scheduler.parallel.group import SINGLE_RANK, TensorParallel
from shared.model_config import ModelConfig

# checkpoint prefix -> ours (text tensors lose theirs: CausalLM's names are transformers' less `model.`)
_RENAMES = (
    ("model.language_model.", ""),
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
)


def _rename(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


@cache
def llava_class(text_cls: type[CausalLM]) -> type[CausalLM]:
    """The LLaVA model whose language model is `text_cls` (one class per family)."""

    class Llava(text_cls):  # type: ignore[valid-type, misc]
        def __init__(
            self, config: ModelConfig, max_positions: int, dtype: torch.dtype | None = None,
            tp: TensorParallel = SINGLE_RANK,
        ) -> None:  # fmt: skip
            super().__init__(config, max_positions, dtype, tp)
            v: dict[str, Any] = config.vision or {}
            self.image_token_id = v.get("image_token_index", v.get("image_token_id"))
            self.vision_tower = ClipVisionTower(
                v["vision_config"], dtype, v.get("vision_feature_layer", -2),
                v.get("vision_feature_select_strategy", "default"),
            )  # fmt: skip
            self.projector = LlavaProjector(
                self.vision_tower.out_dim, config.hidden_size, dtype, v.get("projector_hidden_act", "gelu"),
                bool(v.get("multimodal_projector_bias", True)),
            )  # fmt: skip

        @property
        def tokens_per_image(self) -> int:
            return self.vision_tower.num_tokens

        @torch.inference_mode()
        def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
            """Preprocessed images [N, 3, S, S] -> [N, tokens_per_image, hidden] in the model's dtype."""
            return self.projector(self.vision_tower(pixel_values))

        def num_tiles(self, height: int, width: int) -> int:
            """Tiles the processor makes of a height x width picture (LLaVA-1.5: the one image)."""
            return 1

        def num_image_tokens(self, height: int, width: int) -> int:
            """Rows a height x width picture takes in the prompt."""
            return self.tokens_per_image

        @torch.inference_mode()
        def image_rows(self, tiles: list[torch.Tensor], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
            """Each picture's rows [num_image_tokens, hidden], from its tiles [T, 3, S, S] and its size
            as sent: every tile of every picture through the tower at once (a step's images batched)."""
            counts = [t.shape[0] for t in tiles]
            features = self.projector(self.vision_tower(torch.cat(tiles)))
            return [self.pack_rows(f, size) for f, size in zip(features.split(counts), sizes, strict=True)]

        def pack_rows(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
            """A picture's tiles' rows [T, tokens, hidden] -> its prompt rows (LLaVA-1.5: its one tile's)."""
            return features[0]

        def pieces(self) -> dict[str, Piece | tuple[Piece, ...]]:
            return (
                super().pieces()
                | self.vision_tower.pieces("vision_tower")
                | self.projector.pieces("projector")
            )

        def ignored_weights(self) -> set[str]:
            return super().ignored_weights() | self.vision_tower.ignored("vision_tower")

        def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
            super().load_weights((_rename(name), tensor) for name, tensor in weights)

        def init_dummy(self, seed: int) -> None:
            super().init_dummy(seed)
            self.vision_tower.init_dummy(seed + 1)
            self.projector.init_dummy(seed + 2)

    Llava.__name__ = Llava.__qualname__ = f"Llava{text_cls.__name__.removesuffix('ForCausalLM')}"
    return Llava
