"""The decoder-only transformer every family here is: embeddings, N layers of attention + MLP with
RMSNorms around them, a final norm and the LM head, over the token-level KV pool. A family is an
`Arch` (what differs, read from its config.json) and a `CausalLM` subclass that builds it and names
its checkpoint's tensors; numerics follow transformers', so fp32 greedy output matches it token for
token.

A layer, pre-norm (Llama, Qwen, Mistral, Phi-3, Mixtral):
    h = attn(norm(x)) ; x = x + h ; h = mlp(norm(x)) ; x = x + h
and with Gemma's sandwich norms (`Arch.sandwich`), each block's output is normalised too:
    h = post_attn_norm(attn(norm(x))) ; x = x + h ; h = post_mlp_norm(mlp(norm(x))) ; x = x + h
The residual adds are fused into the next norm (`ops.add_rms_norm`).

Under tensor parallelism (`tp`) each rank builds its share of every layer (models/layers.py) and of
the vocabulary: its rows of the embedding (a token another rank holds looks up zeros; the sum over
ranks is the embedding) and of the LM head (the ranks' logits are gathered into the full row)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.attention.base import AttentionBackend, LayerAttention
from services.scheduler.forward_batch import ForwardBatch, LogitsOutput
from services.scheduler.models.layers import Attention, AttentionShape, Context, GatedMLP, Piece, RMSNorm
from services.scheduler.models.moe import SparseMoE, moe_loop
from services.scheduler.models.ops import TorchOps, TritonOps
from services.scheduler.parallel.group import SINGLE_RANK, TensorParallel
from services.scheduler.parallel.shard import SINGLE, Shard
from services.scheduler.rotary import Rotary
from shared.model_config import ModelConfig

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Experts:
    """A sparse MoE MLP: `num` experts of `intermediate` width, the top `top_k` of the router's
    softmax (renormalised to sum 1 when `renormalize`); `layers`: which layers have it."""

    num: int
    top_k: int
    intermediate: int
    renormalize: bool
    layers: frozenset[int]


@dataclass(frozen=True)
class Arch:
    """What a family's layers are, beyond ModelConfig's shape."""

    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    window: int = 0  # the sliding layers' window
    bias: bool = False  # on q/k/v
    qk_norm: bool = False
    norm_offset: float = 0.0  # Gemma: norms scale by 1 + w
    sandwich: bool = False  # Gemma: norms after attention and MLP too
    act: str = "silu"
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    experts: Experts | None = None
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj as one tensor each


def layer_types(config: ModelConfig, sliding: bool) -> tuple[str, ...]:
    """config.json's `layer_types` (transformers 5 writes it), else every layer SLIDING when the family
    slides (`sliding`) and FULL otherwise."""
    given = config.raw.get("layer_types")
    if given:
        return tuple(given)
    return (SLIDING if sliding else FULL,) * config.num_layers


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, arch: Arch, layer: int, spec: LayerAttention, dtype: torch.dtype | None,
        shard: Shard = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        h, eps, off = config.hidden_size, config.rms_norm_eps, arch.norm_offset
        heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        shape = AttentionShape(*heads, arch.bias, arch.qk_norm)
        self.attn_norm = RMSNorm(h, eps, dtype, off)
        self.attn = Attention(h, shape, layer, spec, eps, off, dtype, shard)
        self.mlp_norm = RMSNorm(h, eps, dtype, off)
        self.post_attn_norm = RMSNorm(h, eps, dtype, off) if arch.sandwich else None
        self.post_mlp_norm = RMSNorm(h, eps, dtype, off) if arch.sandwich else None
        e = arch.experts
        self.mlp: GatedMLP | SparseMoE
        if e is not None and layer in e.layers:
            self.mlp = SparseMoE(h, e.intermediate, e.num, e.top_k, e.renormalize, dtype, shard)
        else:
            self.mlp = GatedMLP(h, config.intermediate_size, arch.act, dtype, shard)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: Context
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings for layer 0), residual: the stream it adds
        to (None for layer 0). Returns this layer's output and the residual stream before it."""
        ops, norm = ctx.ops, self.attn_norm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.attn(h, ctx)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h, ops)
        h, residual = ops.add_rms_norm(h, residual, self.mlp_norm.weight, self.mlp_norm.eps)
        h = self.mlp(h, ctx)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h, ops)
        return h, residual

    def pieces(self, prefix: str, arch: Arch, mlp: str) -> dict[str, Piece | tuple[Piece, ...]]:
        """This layer's checkpoint tensors under `prefix` (`layers.<i>`); `mlp`: the MLP's name there."""
        out = self.attn.pieces(f"{prefix}.self_attn", arch.fused_checkpoint)
        out[f"{prefix}.input_layernorm.weight"] = self.attn_norm.piece()
        if self.post_attn_norm is not None and self.post_mlp_norm is not None:  # Gemma's four norms
            out[f"{prefix}.post_attention_layernorm.weight"] = self.post_attn_norm.piece()
            out[f"{prefix}.pre_feedforward_layernorm.weight"] = self.mlp_norm.piece()
            out[f"{prefix}.post_feedforward_layernorm.weight"] = self.post_mlp_norm.piece()
        else:
            out[f"{prefix}.post_attention_layernorm.weight"] = self.mlp_norm.piece()
        if isinstance(self.mlp, GatedMLP):
            out |= self.mlp.pieces(f"{prefix}.{mlp}", arch.fused_checkpoint)
        return out


class CausalLM(nn.Module):
    """A family subclasses it: `arch(config)` says what its layers are; `expert_pieces` names its
    experts' tensors (MoE families). Built as `cls(config, max_positions, dtype, tp)`, parameters made
    in dtype from the start (tp's rank's share of them); RoPE tables stay float32."""

    mlp_name = "mlp"  # the dense MLP's name in the checkpoint

    @classmethod
    def arch(cls, config: ModelConfig) -> Arch:
        raise NotImplementedError

    def __init__(
        self, config: ModelConfig, max_positions: int, dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config, self.tp = config, tp
        shard = tp.shard
        self.spec = arch = self.arch(config)
        if len(arch.layer_types) != config.num_layers:
            n = len(arch.layer_types)
            raise ValueError(f"layer_types has {n} entries for {config.num_layers} layers")
        rope_params = config.raw.get("rope_parameters") or {}
        if config.raw.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        self.rotaries = {t: Rotary.of(config, max_positions, t) for t in sorted(set(arch.layer_types))}
        h = config.hidden_size
        self.vocab_start, rows = shard.vocab(config.vocab_size)  # rows past the vocabulary: padding
        self.vocab_rows = rows
        self.embed_tokens = nn.Parameter(torch.empty(rows, h, dtype=dtype))
        self.layers = nn.ModuleList(
            DecoderLayer(config, arch, i, self._attention(i), dtype, shard) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype, arch.norm_offset)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(rows, h, dtype=dtype))
        )
        self.embed_scale = float(h**0.5) if arch.embed_scale else None
        self.ops: TorchOps | TritonOps = TorchOps()

    def _attention(self, layer: int) -> LayerAttention:
        arch = self.spec
        kind = arch.layer_types[layer]
        window = arch.window if kind == SLIDING else 0
        return LayerAttention(self.rotaries[kind], arch.attn_scale, window, arch.attn_softcap)

    @property
    def rotary(self) -> Rotary:
        """The full-attention layers' RoPE (or the only one)."""
        return self.rotaries.get(FULL) or next(iter(self.rotaries.values()))

    @property
    def capturable(self) -> bool:
        """Whether a forward can run inside a CUDA graph (the torch MoE loop's shapes depend on routing)."""
        has_moe = any(isinstance(layer.mlp, SparseMoE) for layer in self.layers)
        return not has_moe or self.ops.moe is not moe_loop

    def set_ops(self, ops: TorchOps | TritonOps) -> None:
        self.ops = ops

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, attn: AttentionBackend, logits_out: torch.Tensor | None = None
    ) -> LogitsOutput:
        """Logits (in the model's dtype) for the tokens that sample (fb.logits_idx; every token when
        None), and the final hidden states of fb.lp_idx for prompt logprobs (turned into logits later,
        in slices). logits_out: write the logits there (the CUDA graphs' one static buffer) instead of
        a new tensor."""
        ctx = Context(self.ops, attn, fb, self.tp)
        ids = fb.input_ids
        if fb.mm is not None:  # image slots hold values past the vocabulary (their image's hash)
            ids = ids.clamp(0, self.config.vocab_size - 1)
        x, residual = self.embed(ids), None
        if self.embed_scale is not None:  # rounded to the dtype first, as transformers does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if fb.mm is not None:  # a vision-language model's image rows replace their slots' embeddings
            x = x.index_copy(0, fb.mm.positions, fb.mm.embeds.to(x.dtype))
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        x = x + residual
        lp_hidden = None
        if fb.lp_idx is not None:
            lp_hidden = self.ops.rms_norm(x[fb.lp_idx], self.norm.weight, self.norm.eps)
        last = x if fb.logits_idx is None else x[fb.logits_idx]
        hidden = self.ops.rms_norm(last, self.norm.weight, self.norm.eps)
        return LogitsOutput(self.logits(hidden, logits_out), lp_hidden)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.embed_tokens)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_rows)
        x = F.embedding(torch.where(mine, local, 0), self.embed_tokens)
        return self.tp.all_reduce(x.masked_fill_(~mine[:, None], 0))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states [N, H] -> logits [N, vocab] in the model's dtype (into `out` when
        given), soft-capped where the family caps them (Gemma 2). They stay in that dtype: a greedy
        draw reads them as they are (the argmax of a bf16 row is the argmax of its float32 copy), and
        SampleStep makes the float32 copy only for a batch whose processors or draw need one; on an
        H200 at ~2,400 rows of a 128k vocabulary that copy was a 1.2 GB write every step.
        Under tensor parallelism every rank gets the full logits (each computes its vocabulary rows)."""
        if self.tp.size > 1:
            full = self.tp.gather_columns(F.linear(hidden, self.lm_head))[:, : self.config.vocab_size]
            out = full.contiguous() if out is None else out.copy_(full)
        elif out is None:
            out = F.linear(hidden, self.lm_head)
        else:
            torch.mm(hidden, self.lm_head.t(), out=out)
        cap = self.spec.final_softcap
        if cap:
            out.div_(cap).tanh_().mul_(cap)
        return out

    # -- weights ------------------------------------------------------------------------------
    def expert_pieces(self, prefix: str, moe: SparseMoE) -> dict[str, Piece]:
        raise NotImplementedError(f"{type(self).__name__} has no experts")

    def pieces(self) -> dict[str, Piece | tuple[Piece, ...]]:
        """Every checkpoint tensor this model takes, by its transformers name less `model.`; a tuple
        for a checkpoint tensor that fills several parts (Phi-3's fused q/k/v under tensor parallelism)."""
        start = self.vocab_start
        n = max(0, min(self.vocab_rows, self.config.vocab_size - start))  # this rank's real rows
        rows, src = (slice(0, n),), (slice(start, start + n),)
        out: dict[str, Piece | tuple[Piece, ...]] = {
            "embed_tokens.weight": Piece(self.embed_tokens, rows, src=src),
            "norm.weight": self.norm.piece(),
        }
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = Piece(self.lm_head, rows, src=src)
        for i, layer in enumerate(self.layers):
            out |= layer.pieces(f"layers.{i}", self.spec, self.mlp_name)
            if isinstance(layer.mlp, SparseMoE):
                out |= self.expert_pieces(f"layers.{i}.{self.mlp_name}", layer.mlp)
        return out

    def ignored_weights(self) -> set[str]:
        """Checkpoint tensors this model never uses (a vision tower's unused layers), skipped on load."""
        return set()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Take transformers' tensor names (with or without `model.`), each with a tensor or a
        safetensors slice (read only where this rank's pieces are); every piece must come once."""
        pieces, loaded, ignored = self.pieces(), set(), self.ignored_weights()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings or "rotary_emb" in name:
                continue
            if name in ignored:
                continue
            piece = pieces.get(name)
            if piece is None:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            try:
                for p in piece if isinstance(piece, tuple) else (piece,):
                    p.load(tensor)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            loaded.add(name)
        missing = sorted(set(pieces) - loaded)
        if missing:
            raise ValueError(
                f"incomplete weights: {len(missing)} of {len(pieces)} tensors missing, e.g. {missing[:3]}"
            )

    def init_dummy(self, seed: int) -> None:
        """Random weights (for benchmarks of shapes whose weights are not on the machine): std 0.02,
        norms 1 (their effective scale: Gemma's offset is taken at load)."""
        gen = torch.Generator(device=self.embed_tokens.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
