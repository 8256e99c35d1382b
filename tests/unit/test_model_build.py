"""The model is built in its serving dtype from the start (no float32 copy whose cast would stay in
the CUDA allocator's cache and shrink the KV pool), its RoPE tables stay float32, and the process's
default dtype is never touched (other threads, another Engine's, share it)."""

from __future__ import annotations

import torch
from tiny_llama import tiny_llama

from services.scheduler.model_runner import _build_model
from services.scheduler.models import model_class
from shared.model_config import ModelConfig


def test_parameters_are_made_in_the_serving_dtype_and_rope_stays_float32():
    mc = ModelConfig.from_dict(tiny_llama())
    made: list[torch.dtype] = []
    real = torch.empty

    def spy(*args, **kwargs):  # every parameter starts as torch.empty: record the dtype it gets
        t = real(*args, **kwargs)
        made.append(t.dtype)
        return t

    torch.empty = spy
    set_default = torch.set_default_dtype
    torch.set_default_dtype = None  # the build must not call it
    try:
        model = _build_model(model_class(mc.architecture), mc, 64, torch.device("cpu"), torch.bfloat16)
    finally:
        torch.empty, torch.set_default_dtype = real, set_default
    assert made and set(made) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == torch.float32 and model.rotary.sin.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_an_unknown_architecture_fails_naming_the_supported_ones():
    import pytest

    from shared.model_config import SUPPORTED_ARCHITECTURES

    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(tiny_llama(architectures=["FalconForCausalLM"]))
    message = str(err.value)
    assert "\n" not in message and "'FalconForCausalLM'" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


def test_what_is_not_supported_refuses_to_build():
    import pytest

    partial = tiny_llama(architectures=["Phi3ForCausalLM"], rope_parameters={"partial_rotary_factor": 0.75})
    longrope = tiny_llama(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})
    for cfg, says in ((partial, "partial rotary"), (longrope, "'longrope'; supported: linear, llama3, yarn")):
        mc = ModelConfig.from_dict(cfg)
        with pytest.raises(ValueError, match=says):
            _build_model(model_class(mc.architecture), mc, 64, torch.device("cpu"), torch.float32)
