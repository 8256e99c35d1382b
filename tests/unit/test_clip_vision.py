"""The LLaVA vision half (CLIP tower + projector) against transformers' own LlavaForConditionalGeneration
in fp32: a tiny random model, its weights re-drawn larger than transformers' init (so a wrong norm, a
swapped q/k slice or the wrong layer shows), loaded from its state dict under both checkpoint layouts."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from services.scheduler.models.vision.clip import CLIP_DEFAULTS, LAYER_TENSORS, ClipVisionTower
from services.scheduler.models.vision.projector import LlavaProjector

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
VISION |= dict(image_size=56, patch_size=14)
TEXT = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
TEXT |= dict(num_attention_heads=4, num_key_value_heads=2)
# transformers 5 names (its state_dict) -> the published llava-hf checkpoints' (transformers 4) names
LAYOUTS = {
    "transformers5": ("model.vision_tower", "model.multi_modal_projector"),
    "llava-hf": ("vision_tower.vision_model", "multi_modal_projector"),
}


@cache
def reference(layers: int) -> LlavaForConditionalGeneration:
    """A model whose projector takes `layers` feature layers (its width is fixed by the config)."""
    torch.manual_seed(layers)
    feature_layer: int | list[int] = -2 if layers == 1 else [-2, -1]
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION), text_config=LlamaConfig(**TEXT),
        image_token_index=49151, vision_feature_layer=feature_layer,
    )  # fmt: skip
    model = LlavaForConditionalGeneration(config).eval()  # default attention (sdpa): ~1e-7 off eager
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name or name.startswith("lm_head"):
                continue
            if "norm" in name:  # layer_norm1/2, pre_layrnorm, post_layernorm: weight ~1, bias ~0
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
            else:
                p.normal_(0.0, 0.08)
    return model


def checkpoint(model: LlavaForConditionalGeneration, layout: str) -> dict[str, torch.Tensor]:
    tower, proj = LAYOUTS[layout]
    out = {}
    for name, t in model.state_dict().items():
        name = name.replace("model.vision_tower.", f"{tower}.", 1)
        out[name.replace("model.multi_modal_projector.", f"{proj}.", 1)] = t
    return out


def load(module: Any, prefix: str, state: dict[str, torch.Tensor]) -> None:
    """As a loader would: every checkpoint tensor under prefix is taken or ignored, every piece comes."""
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))
    pieces = module.pieces(prefix)
    ignored = module.ignored(prefix) if isinstance(module, ClipVisionTower) else set()
    names = {n for n in state if n.startswith(f"{prefix}.")}
    assert not pieces.keys() & ignored
    assert names - ignored == set(pieces), (
        sorted(names - ignored - set(pieces)),
        sorted(set(pieces) - names),
    )
    for name, piece in pieces.items():
        piece.load(state[name])
    assert all(not p.isnan().any() for p in module.parameters())  # the pieces cover every element


def build(layout: str, feature_layer: int | list[int], select: str) -> tuple[ClipVisionTower, LlavaProjector]:
    model = reference(1 if isinstance(feature_layer, int) else len(feature_layer))
    # transformers 5 writes every vision_config key; llava-hf's config.json (transformers 4) only the
    # non-default ones: no hidden_act, layer_norm_eps or num_channels
    config = model.config.vision_config.to_dict() if layout == "transformers5" else dict(VISION)
    tower = ClipVisionTower(config, torch.float32, feature_layer, select)
    projector = LlavaProjector(
        tower.out_dim, TEXT["hidden_size"], torch.float32, model.config.projector_hidden_act
    )
    state = checkpoint(model, layout)
    tower_prefix, proj_prefix = LAYOUTS[layout]
    load(tower, tower_prefix, state)
    load(projector, proj_prefix, state)
    return tower, projector


def images(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(7))


def expected(feature_layer: int | list[int], select: str, pixels: torch.Tensor) -> torch.Tensor:
    model = reference(1 if isinstance(feature_layer, int) else len(feature_layer))
    # transformers 5.25 turns vision_feature_layer into output_hidden_states, where a bare 0 reads as
    # False and captures nothing (hidden_states is None): ask for all of them then
    everything = {"output_hidden_states": True} if feature_layer == 0 else {}
    with torch.no_grad():
        out = model.get_image_features(
            pixel_values=pixels, vision_feature_layer=feature_layer, vision_feature_select_strategy=select,
            **everything,
        )  # fmt: skip
    # transformers 5.25: a BaseModelOutputWithPooling whose pooler_output is a list, one [tokens, text
    # hidden] tensor per image (projected); hidden_states holds None for the layers not selected
    assert isinstance(out.pooler_output, list) and len(out.pooler_output) == len(pixels)
    return torch.stack(out.pooler_output)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("select", ["default", "full"])
@pytest.mark.parametrize("feature_layer", [-2, -1, 0, [-2, -1], [0, -2]], ids=str)
def test_features_equal_transformers_get_image_features(layout, select, feature_layer):
    tower, projector = build(layout, feature_layer, select)
    pixels = images()
    with torch.no_grad():
        feats = tower(pixels)
        ours = projector(feats)
    want = expected(feature_layer, select, pixels)
    tokens = 16 + (select == "full")
    assert feats.shape == (2, tokens, tower.out_dim) and tower.num_tokens == tokens
    assert ours.shape == want.shape == (2, tokens, TEXT["hidden_size"])
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)


def test_the_layers_checked_differ_so_a_wrong_layer_would_show():
    pixels = images()
    a, b = expected(-2, "default", pixels), expected(-1, "default", pixels)
    assert (a - b).abs().max() > 0.05 and a.abs().mean() > 0.05


def test_only_the_needed_layers_are_built_and_the_rest_are_ignored():
    tower = ClipVisionTower(VISION, torch.float32, -2)
    assert len(tower.layers) == 2  # hidden_states[-2]: the output of layer 1 of 0..2
    skipped = {f"v.encoder.layers.2.{t}" for t in LAYER_TENSORS}
    assert skipped | {"v.post_layernorm.weight", "v.post_layernorm.bias"} <= tower.ignored("v")
    assert not any(n.startswith("v.encoder.layers.2.") for n in tower.pieces("v"))
    assert len(ClipVisionTower(VISION, torch.float32, 0).layers) == 0
    assert len(ClipVisionTower(VISION, torch.float32, [-1, 1]).layers) == 3


def test_defaults_are_clip_vision_configs():
    defaults = CLIPVisionConfig()
    assert {k: getattr(defaults, k) for k in CLIP_DEFAULTS} == CLIP_DEFAULTS


def test_unsupported_activation_names_the_allowed_ones():
    with pytest.raises(ValueError, match="'relu'.*quick_gelu, gelu, gelu_pytorch_tanh"):
        ClipVisionTower(VISION | {"hidden_act": "relu"}, torch.float32)
    with pytest.raises(ValueError, match="'relu'.*quick_gelu, gelu, gelu_pytorch_tanh"):
        LlavaProjector(32, 64, torch.float32, act="relu")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"select": "cls"}, "select strategy"), ({"feature_layer": -5}, "feature layers"),
     ({"feature_layer": []}, "feature layers"), ({"feature_layer": 4}, "feature layers")],
)  # fmt: skip
def test_bad_selection_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClipVisionTower(VISION, torch.float32, **kwargs)


def test_wrong_image_size_is_refused():
    with pytest.raises(ValueError, match="56x56"):
        ClipVisionTower(VISION, torch.float32)(torch.zeros(1, 3, 28, 28))


def test_init_dummy_is_seeded_with_unit_norms():
    tower, projector = ClipVisionTower(VISION, torch.float32), LlavaProjector(32, 64, torch.float32)
    tower.init_dummy(3)
    projector.init_dummy(3)
    first = tower.layers[0].qkv_proj.weight.clone()
    assert torch.equal(tower.pre_layrnorm.weight, torch.ones(32))
    assert torch.equal(tower.layers[1].layer_norm2.bias, torch.zeros(32))
    assert 0.015 < first.std() < 0.025 and 0.015 < projector.linear_1.weight.std() < 0.025
    tower.init_dummy(3)
    assert torch.equal(tower.layers[0].qkv_proj.weight, first)
    assert projector(tower(images(1))).isfinite().all()
