"""The model is built in its serving dtype from the start (no float32 copy whose cast would stay in
the CUDA allocator's cache and shrink the KV pool), its RoPE tables stay float32, and the process's
default dtype is left as it was, also when the build raises."""

from __future__ import annotations

import pytest
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
    try:
        model = _build_model(model_class(mc.architecture), mc, 64, torch.device("cpu"), torch.bfloat16)
    finally:
        torch.empty = real
    assert made and set(made) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == torch.float32 and model.rotary.sin.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_the_default_dtype_comes_back_when_the_build_raises():
    class Broken(torch.nn.Module):
        def __init__(self, *_):
            raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        _build_model(Broken, None, 64, torch.device("cpu"), torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
