"""CLIP's vision transformer as LLaVA uses it: patch features taken from one hidden layer (or several,
concatenated), not the pooled CLS output, so `post_layernorm` and every layer past the deepest one
selected are never run. Numerics follow transformers' eager CLIP (modeling_clip.py): conv patch
embedding without bias, CLS + position embeddings, `pre_layrnorm`, then pre-norm blocks whose
softmax is taken in float32; `hidden_states[0]` is the embeddings after `pre_layrnorm`.

Parameters are made with `torch.empty` in the model's dtype (filled by the loader or `init_dummy`);
q/k/v are one fused weight (one GEMM) that the three checkpoint tensors fill as row slices (`Piece`).
The checkpoint tensors that are not needed (post_layernorm, the skipped layers, an old checkpoint's
`embeddings.position_ids`) get no parameter: `ignored(prefix)` names them so a loader may skip them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.models.layers import Piece

# CLIPVisionConfig's defaults: a saved config.json keeps only the values that differ from them (the
# llava-hf checkpoints' vision_config has no hidden_act or layer_norm_eps), so a missing key means these.
CLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "image_size": 224, "patch_size": 32, "num_channels": 3, "layer_norm_eps": 1e-5,
    "hidden_act": "quick_gelu",
}  # fmt: skip

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's own approximation
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}

# Every tensor of one encoder layer, under `<prefix>.encoder.layers.<i>`.
LAYER_TENSORS = tuple(
    f"{m}.{p}"
    for m in ("layer_norm1", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    + ("self_attn.out_proj", "layer_norm2", "mlp.fc1", "mlp.fc2")
    for p in ("weight", "bias")
)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ACT2FN name -> the function (only those CLIP and the LLaVA projector use)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Linear(nn.Module):
    """x @ W.T + b, its parameters left empty (nn.Linear would initialise them only to be overwritten)."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype | None, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(d_out, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def pieces(self, prefix: str, rows: slice | None = None) -> dict[str, Piece]:
        """`<prefix>.weight` (and `.bias`), filling this layer or, for a fused one, its `rows`."""
        index = (rows,) if rows is not None else ()
        out = {f"{prefix}.weight": Piece(self.weight, index)}
        if self.bias is not None:
            out[f"{prefix}.bias"] = Piece(self.bias, index)
        return out


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def pieces(self, prefix: str) -> dict[str, Piece]:
        return {f"{prefix}.weight": Piece(self.weight), f"{prefix}.bias": Piece(self.bias)}


def init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights for runs without a checkpoint (as `CausalLM.init_dummy`): std 0.02, norms 1 and 0."""
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    skip = {id(p) for m in norms for p in (m.weight, m.bias)}
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in skip:
                p.normal_(0.0, 0.02, generator=gen)
        for m in norms:
            m.weight.fill_(1.0)
            m.bias.zero_()


class ClipLayer(nn.Module):
    """x + attn(layer_norm1(x)), then + fc2(act(fc1(layer_norm2(x)))); bidirectional, no mask."""

    def __init__(self, c: dict[str, Any], dtype: torch.dtype | None) -> None:
        super().__init__()
        h, eps = c["hidden_size"], c["layer_norm_eps"]
        self.hidden, self.heads = h, c["num_attention_heads"]
        self.head_dim = h // self.heads
        self.scale = self.head_dim**-0.5
        self.act = activation(c["hidden_act"])
        self.layer_norm1 = LayerNorm(h, eps, dtype)
        self.qkv_proj = Linear(h, 3 * h, dtype)
        self.out_proj = Linear(h, h, dtype)
        self.layer_norm2 = LayerNorm(h, eps, dtype)
        self.fc1 = Linear(h, c["intermediate_size"], dtype)
        self.fc2 = Linear(c["intermediate_size"], h, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        qkv = self.qkv_proj(self.layer_norm1(x)).view(n, t, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [n, heads, t, head_dim]
        w = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        x = x + self.out_proj(torch.matmul(w, v).transpose(1, 2).reshape(n, t, h))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))

    def pieces(self, prefix: str) -> dict[str, Piece]:
        h = self.hidden
        out = self.layer_norm1.pieces(f"{prefix}.layer_norm1")
        out |= self.layer_norm2.pieces(f"{prefix}.layer_norm2")
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out |= self.qkv_proj.pieces(f"{prefix}.self_attn.{name}", slice(i * h, (i + 1) * h))
        out |= self.out_proj.pieces(f"{prefix}.self_attn.out_proj")
        return out | self.fc1.pieces(f"{prefix}.mlp.fc1") | self.fc2.pieces(f"{prefix}.mlp.fc2")


class ClipVisionTower(nn.Module):
    """pixel_values [N, C, S, S] -> [N, patches (+1 with select "full"), hidden * len(feature layers)]."""

    def __init__(
        self, config: dict[str, Any], dtype: torch.dtype | None = None,
        feature_layer: int | Sequence[int] = -2, select: str = "default",
    ) -> None:  # fmt: skip
        """config: LLaVA config.json's `vision_config`; feature_layer: its `vision_feature_layer` (an
        index into hidden_states, which has num_hidden_layers + 1 entries); select: its
        `vision_feature_select_strategy` ("default" drops the CLS token, "full" keeps it)."""
        super().__init__()
        c = CLIP_DEFAULTS | config
        if select not in ("default", "full"):
            raise ValueError(f"unsupported select strategy {select!r}; supported: default, full")
        activation(c["hidden_act"])  # raise before allocating anything
        self.num_layers, states = c["num_hidden_layers"], c["num_hidden_layers"] + 1
        wanted = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
        if not wanted or any(not -states <= f < states for f in wanted):
            raise ValueError(f"feature layers {feature_layer} are not in [-{states}, {states}) hidden states")
        self.feature_states = tuple(f % states for f in wanted)
        self.select = select
        h, p = c["hidden_size"], c["patch_size"]
        self.hidden, self.image_size, self.patch_size = h, c["image_size"], p
        self.grid = c["image_size"] // p
        self.class_embedding = nn.Parameter(torch.empty(h, dtype=dtype))
        self.patch_embedding = nn.Parameter(torch.empty(h, c["num_channels"], p, p, dtype=dtype))
        self.position_embedding = nn.Parameter(torch.empty(self.grid**2 + 1, h, dtype=dtype))
        self.pre_layrnorm = LayerNorm(h, c["layer_norm_eps"], dtype)
        self.layers = nn.ModuleList(ClipLayer(c, dtype) for _ in range(max(self.feature_states)))

    @property
    def out_dim(self) -> int:
        """Width of each output token: the projector's input."""
        return self.hidden * len(self.feature_states)

    @property
    def num_tokens(self) -> int:
        """Output tokens per image (the image's placeholder count in the prompt)."""
        return self.grid**2 + (self.select == "full")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"image is {height}x{width}, not {self.image_size}x{self.image_size}")
        w = self.patch_embedding
        x = F.conv2d(pixel_values.to(w.dtype), w, stride=self.patch_size)  # [n, hidden, grid, grid]
        x = torch.cat([self.class_embedding.expand(n, 1, -1), x.flatten(2).transpose(1, 2)], dim=1)
        x = self.pre_layrnorm(x + self.position_embedding)
        kept = {0: x} if 0 in self.feature_states else {}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if i in self.feature_states:
                kept[i] = x
        chosen = [kept[i] for i in self.feature_states]
        out = chosen[0] if len(chosen) == 1 else torch.cat(chosen, dim=-1)
        return out if self.select == "full" else out[:, 1:]

    def pieces(self, prefix: str) -> dict[str, Piece]:
        """Every tensor this tower takes, by transformers' CLIPVisionModel name under `prefix`
        (transformers 5: `model.vision_tower`; llava-hf checkpoints: `vision_tower.vision_model`)."""
        e = f"{prefix}.embeddings"
        out = {
            f"{e}.class_embedding": Piece(self.class_embedding),
            f"{e}.patch_embedding.weight": Piece(self.patch_embedding),
            f"{e}.position_embedding.weight": Piece(self.position_embedding),
        } | self.pre_layrnorm.pieces(f"{prefix}.pre_layrnorm")
        for i, layer in enumerate(self.layers):
            out |= layer.pieces(f"{prefix}.encoder.layers.{i}")
        return out

    def ignored(self, prefix: str) -> set[str]:
        """The checkpoint's tensors under `prefix` this tower never uses: a loader skips them."""
        names = {f"{prefix}.post_layernorm.weight", f"{prefix}.post_layernorm.bias"}
        names.add(f"{prefix}.embeddings.position_ids")  # a buffer older transformers saved
        for i in range(len(self.layers), self.num_layers):
            names |= {f"{prefix}.encoder.layers.{i}.{t}" for t in LAYER_TENSORS}
        return names

    def init_dummy(self, seed: int) -> None:
        init_dummy(self, seed)
