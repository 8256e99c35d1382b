"""Mistral and Mixtral: Llama's layers with a sliding window on every layer where `sliding_window` is
set (Mistral 7B v0.1: 4,096), and Mixtral's sparse MLP: 8 experts, the top 2 of the router's softmax,
renormalised (`block_sparse_moe`, experts `w1` gate, `w3` up, `w2` down)."""

from __future__ import annotations

from services.scheduler.models.decoder import Arch, CausalLM, Experts, layer_types
from services.scheduler.models.layers import Piece
from services.scheduler.models.moe import SparseMoE
from shared.model_config import ModelConfig


def _sliding(config: ModelConfig) -> dict:
    window = config.raw.get("sliding_window") or 0
    return {"layer_types": layer_types(config, sliding=bool(window)), "window": window}


class MistralForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        return Arch(**_sliding(config))


class MixtralForCausalLM(CausalLM):
    mlp_name = "block_sparse_moe"

    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        raw = config.raw
        experts = Experts(
            num=raw.get("num_local_experts") or raw["num_experts"], top_k=raw["num_experts_per_tok"],
            intermediate=config.intermediate_size, renormalize=True,
            layers=frozenset(range(config.num_layers)),
        )  # fmt: skip
        return Arch(**_sliding(config), experts=experts)

    def expert_pieces(self, prefix: str, moe: SparseMoE) -> dict[str, Piece]:
        return moe.pieces(prefix, "gate", ("w1", "w3", "w2"))
