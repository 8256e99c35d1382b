"""LLaVA's multi-modal projector: linear_2(act(linear_1(features))) maps the vision tower's patch
features into the text model's embedding space, one output row per image token. Parameters are
made with `torch.empty` in the model's dtype and filled from the checkpoint through `Piece`s."""

from __future__ import annotations

import torch
from torch import nn

from services.scheduler.models.layers import Piece
from services.scheduler.models.vision.clip import Linear, activation, init_dummy


class LlavaProjector(nn.Module):
    def __init__(
        self, in_features: int, text_hidden: int, dtype: torch.dtype | None = None,
        act: str = "gelu", bias: bool = True,
    ) -> None:  # fmt: skip
        """in_features: the tower's `out_dim` (vision hidden_size times the number of feature layers);
        text_hidden: the text model's hidden_size; act: config.json's `projector_hidden_act` ("gelu",
        exact erf, in LLaVA-1.5); bias: its `multimodal_projector_bias` (default true)."""
        super().__init__()
        self.act = activation(act)
        self.linear_1 = Linear(in_features, text_hidden, dtype, bias)
        self.linear_2 = Linear(text_hidden, text_hidden, dtype, bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))

    def pieces(self, prefix: str) -> dict[str, Piece]:
        """`<prefix>.linear_1.weight` ... (transformers 5: `model.multi_modal_projector`; llava-hf
        checkpoints: `multi_modal_projector`)."""
        return self.linear_1.pieces(f"{prefix}.linear_1") | self.linear_2.pieces(f"{prefix}.linear_2")

    def init_dummy(self, seed: int) -> None:
        init_dummy(self, seed)
