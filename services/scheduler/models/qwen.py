"""Qwen2 / Qwen2.5 (bias on q, k and v), Qwen3 (RMSNorm on each head of q and k before RoPE, an
explicit head_dim) and Qwen3-MoE (Qwen3's attention; experts in the layers `decoder_sparse_step`
and `mlp_only_layers` leave sparse: the top k of the router's softmax, e.g. 8 of 128, renormalised
when `norm_topk_prob`). A sliding window only with `use_sliding_window` (Qwen2.5 ships a
`sliding_window` it does not use), on the layers `layer_types` says, or from `max_window_layers` on."""

from __future__ import annotations

from services.scheduler.models.decoder import FULL, SLIDING, Arch, CausalLM, Experts
from services.scheduler.models.layers import Piece
from services.scheduler.models.moe import SparseMoE
from shared.model_config import ModelConfig


def _sliding(config: ModelConfig, all_layers: bool = False) -> dict:
    """all_layers: Qwen3-MoE's window is on every layer (transformers' Qwen3MoeAttention)."""
    raw = config.raw
    window = (raw.get("sliding_window") or 0) if raw.get("use_sliding_window") else 0
    n = config.num_layers
    if not window:
        return {"layer_types": (FULL,) * n}
    if all_layers:
        return {"layer_types": (SLIDING,) * n, "window": window}
    first = raw.get("max_window_layers", n)
    types = raw.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)]
    return {"layer_types": tuple(types), "window": window}


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        return Arch(**_sliding(config), bias=True)


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        return Arch(**_sliding(config), bias=bool(config.raw.get("attention_bias")), qk_norm=True)


class Qwen3MoeForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        raw = config.raw
        num = raw.get("num_experts") or raw["num_local_experts"]  # transformers 5 writes the latter
        step, dense = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
        sparse = {i for i in range(config.num_layers) if i not in dense and num > 0 and (i + 1) % step == 0}
        experts = Experts(
            num=num, top_k=raw["num_experts_per_tok"], intermediate=raw["moe_intermediate_size"],
            renormalize=bool(raw.get("norm_topk_prob", False)), layers=frozenset(sparse),
        )  # fmt: skip
        bias = bool(raw.get("attention_bias"))
        return Arch(**_sliding(config, all_layers=True), bias=bias, qk_norm=True, experts=experts)

    def expert_pieces(self, prefix: str, moe: SparseMoE) -> dict[str, Piece]:
        return moe.pieces(prefix, "gate", ("gate_proj", "up_proj", "down_proj"))
